"""Starting radixserve's services as separate processes: `make run`, and the one place tests and benchmarks start
them too.

Each service is its own process, started from its CLI exactly as an operator would. `Stack` waits for each to report
SERVING over gRPC health checking before starting the next, and stops them in reverse order with SIGTERM. Every
child dies with the thread that started it, even when the launcher is SIGKILLed: it gets SIGTERM from the kernel
(Linux's PR_SET_PDEATHSIG, which the child asks for itself at start: `radixserve.server.die_with_launcher`) and
drains as on any SIGTERM. `LocalServices` adds free loopback ports, a log file per
service and restarts, sized for one small machine.

`python -m radixserve.launch` (`make run`) runs kvcached, a worker and the router until the first SIGINT or SIGTERM,
then stops them in reverse start order, each with SIGTERM and SIGKILL past `STOP_GRACE_S`; it ignores every later
signal, so a supervisor or `docker stop` that signals the whole process group twice cannot cut the shutdown short.
The children run in their own process groups, so those signals reach the launcher only. Its flags
(`LaunchConfig`) move the three gRPC ports and turn the services' metrics endpoints off, so that a second stack (a
test) can run beside the first.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixserve.blocks.slab import segment_pid
from radixserve.config import parse_config, setting
from radixserve.server import LAUNCHER_PID_ENV
from radixserve.transport import PLAINTEXT, TransportSecurity, open_channel
from radixserve.v1 import worker_pb2, worker_pb2_grpc

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A loopback port nobody listens on now (another process may still take it before we do)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(address: str, process: subprocess.Popen, timeout_s: float,
                 security: TransportSecurity = PLAINTEXT) -> None:
    """Blocks until `address` reports SERVING (asked with `security`); raises if `process` exits or `timeout_s`
    passes first."""
    deadline = time.monotonic() + timeout_s
    serving = health_pb2.HealthCheckResponse.SERVING
    with open_channel(address, security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{process.args[2]} exited with {process.returncode} before serving {address}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == serving:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not serving after {timeout_s:.0f} s")


def wait_for(condition, timeout_s: float = 20) -> bool:
    """Polls `condition()` until it holds (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@dataclass
class Stack:
    """Processes started in order and stopped in reverse; usable as a context manager. Each gets `security`'s
    flags (TLS files, the token) before its own, and is health-checked with them."""

    processes: list[subprocess.Popen] = field(default_factory=list)
    security: TransportSecurity = PLAINTEXT

    def start(self, module: str, port: int, args: list[str], timeout_s: float = 300, **popen) -> subprocess.Popen:
        """`python -m module --port port *args`, once it serves; `popen` goes to `subprocess.Popen`. The process
        gets SIGTERM when the calling thread exits (see `die_with_launcher`): call this from a thread that outlives
        the service, the main thread in the launcher and in test fixtures. Tests want that too: a pytest run that
        is killed leaves no services on ports or pools in /dev/shm.

        NOTE: not a `preexec_fn`: that forces a plain fork of a process whose gRPC threads and fork handlers then
        run in the child before exec; seen here to abort the child (epoll_wait: Bad file descriptor)."""
        env = {**popen.pop("env", os.environ), LAUNCHER_PID_ENV: str(os.getpid())}
        process = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), *self.security.flags(), *args],
                                   env=env, **popen)
        self.processes.append(process)
        wait_healthy(f"127.0.0.1:{port}", process, timeout_s, self.security)
        return process

    def stop_process(self, process: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 30) -> int:
        """Sends `sig` (SIGKILL past `timeout_s`), forgets the process and returns its exit code."""
        if process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process in self.processes:
            self.processes.remove(process)
        return process.returncode

    def stop(self, timeout_s: float = 30) -> None:
        """Stops every process, last started first, each with SIGTERM and SIGKILL past `timeout_s`."""
        for process in reversed(list(self.processes)):
            self.stop_process(process, timeout_s=timeout_s)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass(frozen=True)
class _Launch:
    module: str
    port: int
    args: tuple[str, ...]


@dataclass
class LocalServices:
    """Services on free loopback ports, each logging to `log_dir/<name>.log`, metrics off; `start_*` return the
    new service's address. Sized for one small machine: 0.5 GiB of L2, a 1 GiB disk tier under `log_dir`, 0.25 GiB
    of L1 per worker, unless the extra arguments say otherwise."""

    log_dir: Path
    stack: Stack = field(default_factory=Stack)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    _launches: dict[str, _Launch] = field(default_factory=dict)

    def start(self, module: str, name: str, args: list[str]) -> str:
        """Starts `module` as service `name` on a free port, with `args` after the common flags."""
        self._launches[name] = _Launch(module, free_port(), ("--metrics-port", "0", *args))
        return self._run(name, self._launches[name].args)

    def _run(self, name: str, args: tuple[str, ...]) -> str:
        launch = self._launches[name]
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self.processes[name] = self.stack.start(launch.module, launch.port, list(args), stdout=log,
                                                    stderr=subprocess.STDOUT, cwd=REPO)
        return f"127.0.0.1:{launch.port}"

    def kvcached(self, name: str = "kvcached", args: list[str] = ()) -> str:
        """A daemon with its own disk tier under the log directory (a restart finds it)."""
        disk = ["--disk-cache-path", str(self.log_dir / f"{name}-l3"), "--disk-cache-size-gb", "1"]
        return self.start("kvcached", name, ["--host-cache-size-gb", "0.5", *disk, *args])

    def worker(self, kvcached: str, name: str = "worker", args: list[str] = ()) -> str:
        return self.start("model_worker", name, ["--kvcached", kvcached, "--l1-cache-size-gb", "0.25", *args])

    def router(self, workers: list[str], kvcached: str, name: str = "router", args: list[str] = (),
               http_port: int = 0) -> str:
        """`http_port` 0: no HTTP API (off, like metrics, so that stacks side by side never collide on it)."""
        worker_flags = [flag for w in workers for flag in ("--worker", w)]
        return self.start("router", name, [*worker_flags, "--kvcached", kvcached, "--http-port", str(http_port),
                                           *args])

    def kvcached_and_two_workers(self) -> tuple[str, str, str]:
        """kvcached, then worker_a and worker_b sharing it: the addresses, in that order."""
        kvcached = self.kvcached()
        return kvcached, self.worker(kvcached, "worker_a"), self.worker(kvcached, "worker_b")

    def stop_service(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        """Stops service `name` with `sig`; its exit code (0 after a clean drain)."""
        return self.stack.stop_process(self.processes.pop(name), sig, timeout_s)

    def start_again(self, name: str, extra_args: list[str] = ()) -> str:
        """Restarts a stopped service on its port with the arguments it first started with, then `extra_args`
        (a later flag wins)."""
        return self._run(name, (*self._launches[name].args, *extra_args))

    def workers_registered(self, workers: list[str], kvcached: str = "kvcached", timeout_s: float = 20) -> bool:
        """Waits until every worker has registered with service `kvcached` as it runs now (say, after a restart:
        until then a worker recomputes what the new daemon leases); False after `timeout_s`."""
        pid = self.processes[kvcached].pid

        def registered(worker: str) -> bool:
            with open_channel(worker, self.stack.security) as channel:
                info = worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
            return segment_pid(info.kvcached_segment) == pid

        return wait_for(lambda: all(registered(w) for w in workers), timeout_s)

    def stop(self) -> None:
        self.stack.stop()
        self.processes.clear()


EXAMPLE = """
radixserve is up: router on 127.0.0.1:{router}, kvcached on 127.0.0.1:{kvcached}, worker on 127.0.0.1:{worker}.
Try:

  .venv/bin/grpcurl -plaintext -d '{{"messages": [{{"role": "user", "content": "What is the capital of France?"}}],
      "sampling": {{"temperature": 0, "max_new_tokens": 32}}, "stream": true}}' \\
      127.0.0.1:{router} radixserve.v1.Router/Generate

Ctrl-C stops everything.
"""


@dataclass(frozen=True)
class LaunchConfig(TransportSecurity):
    """radixserve launcher (`make run`): kvcached, one model worker and the router on loopback, until SIGINT or
    SIGTERM. The TLS and token flags go to all three services."""

    router_port: int = setting(50051, "the router's gRPC port: the public API")
    kvcached_port: int = setting(50052, "kvcached's gRPC port")
    worker_port: int = setting(50053, "the model worker's gRPC port")
    metrics: bool = setting(True, "each service's Prometheus endpoint on its default port (9101-9103); "
                                  "--no-metrics turns them off, e.g. beside another stack")
    otlp_traces_endpoint: str = setting("", "each service's --otlp-traces-endpoint (e.g. http://127.0.0.1:4317); "
                                            "empty: the OTEL_* variables decide, and without them tracing is off")


# Idle services stop in well under a second. This cuts a long drain short (the worker's and the router's grace is
# 10 s), so that the stack is gone within about 15 s whatever runs; a supervisor that SIGKILLs the launcher sooner
# (docker stop waits 10 s) leaves no orphans either: the children get SIGTERM from the kernel.
STOP_GRACE_S = 5.0


class _Shutdown(BaseException):
    """Raised in the main thread by the first SIGINT or SIGTERM; a BaseException so that no handler swallows it."""


def _shutdown_on_signal(signum: int, frame: object) -> None:
    _ignore_signals()
    raise _Shutdown


def _ignore_signals() -> None:
    """From here on nothing interrupts the shutdown: later signals are dropped."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _start_all(stack: Stack, config: LaunchConfig) -> None:
    """kvcached, then the worker, then the router, each once it serves. Children run in their own process groups
    (process_group=0), so a terminal's Ctrl-C or a signal to the launcher's group reaches only the launcher."""
    kvcached, worker = f"127.0.0.1:{config.kvcached_port}", f"127.0.0.1:{config.worker_port}"
    common = ([] if config.metrics else ["--metrics-port", "0"]) + (
        ["--otlp-traces-endpoint", config.otlp_traces_endpoint] if config.otlp_traces_endpoint else [])
    print(f"starting kvcached on {kvcached}", flush=True)
    stack.start("kvcached", config.kvcached_port, common, process_group=0)
    print(f"starting the model worker on {worker} (loading the model)", flush=True)
    stack.start("model_worker", config.worker_port, [*common, "--kvcached", kvcached], process_group=0)
    print(f"starting the router on 127.0.0.1:{config.router_port}", flush=True)
    stack.start("router", config.router_port, [*common, "--worker", worker, "--kvcached", kvcached],
                process_group=0)


def main(argv: list[str] | None = None) -> None:
    """`make run`: the stack until the first SIGINT or SIGTERM, which may come while it starts; exits 1 when a
    service exited by itself."""
    config = parse_config(LaunchConfig, argv)
    stack = Stack(security=config)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _shutdown_on_signal)
    try:
        _start_all(stack, config)
        print(EXAMPLE.format(router=config.router_port, kvcached=config.kvcached_port, worker=config.worker_port),
              flush=True)
        while all(p.poll() is None for p in stack.processes):
            time.sleep(0.5)
        print("a service exited; stopping the others", file=sys.stderr)
        raise SystemExit(1)
    except _Shutdown:
        print("\nstopping", file=sys.stderr)
    finally:
        _ignore_signals()
        stack.stop(STOP_GRACE_S)


if __name__ == "__main__":
    main()
