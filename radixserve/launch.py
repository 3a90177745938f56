"""Starting radixserve's services as separate processes: `make run`, and the one place tests and benchmarks start
them too.

Each service is its own process, started from its CLI exactly as an operator would. `Stack` waits for each to report
SERVING over gRPC health checking before starting the next, and stops them in reverse order with SIGTERM.
`LocalServices` adds free loopback ports, a log file per service and restarts, sized for one small machine.
"""

from __future__ import annotations

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
from radixserve.v1 import worker_pb2, worker_pb2_grpc

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A loopback port nobody listens on now (another process may still take it before we do)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(address: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Blocks until `address` reports SERVING; raises if `process` exits or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    serving = health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(address) as channel:
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
    """Processes started in order and stopped in reverse; usable as a context manager."""

    processes: list[subprocess.Popen] = field(default_factory=list)

    def start(self, module: str, port: int, args: list[str], timeout_s: float = 300, **popen) -> subprocess.Popen:
        """`python -m module --port port *args`, once it serves; `popen` goes to `subprocess.Popen`."""
        process = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), *args], **popen)
        self.processes.append(process)
        wait_healthy(f"127.0.0.1:{port}", process, timeout_s)
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

    def router(self, workers: list[str], kvcached: str, name: str = "router", args: list[str] = ()) -> str:
        worker_flags = [flag for w in workers for flag in ("--worker", w)]
        return self.start("router", name, [*worker_flags, "--kvcached", kvcached, *args])

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
            with grpc.insecure_channel(worker) as channel:
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


def main() -> None:
    """`make run`: kvcached, a worker and the router on their default ports, until Ctrl-C."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with Stack() as stack:
        # Children ignore the terminal's SIGINT; the Stack stops them in reverse order with SIGTERM instead.
        print("starting kvcached on 127.0.0.1:50052", flush=True)
        stack.start("kvcached", 50052, [], process_group=0)
        print("starting the model worker on 127.0.0.1:50053 (loading the model)", flush=True)
        stack.start("model_worker", 50053, ["--kvcached", "127.0.0.1:50052"], process_group=0)
        print("starting the router on 127.0.0.1:50051", flush=True)
        stack.start("router", 50051, ["--worker", "127.0.0.1:50053", "--kvcached", "127.0.0.1:50052"],
                    process_group=0)
        print(EXAMPLE.format(router=50051, kvcached=50052, worker=50053), flush=True)
        try:
            while all(p.poll() is None for p in stack.processes):
                time.sleep(0.5)
            print("a service exited; stopping the others", file=sys.stderr)
        except KeyboardInterrupt:
            print("\nstopping", file=sys.stderr)


if __name__ == "__main__":
    main()
