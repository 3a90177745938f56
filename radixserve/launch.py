"""Starts the stack as separate processes on loopback (`make run`), and the same helpers serve the tests.

Each service is its own process, started from its CLI exactly as an operator would; `Stack` waits for each to
report SERVING over gRPC health checking before starting the next, and stops them in reverse order with SIGTERM.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def wait_healthy(address: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Blocks until `address` reports SERVING; raises if `process` exits or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{process.args[2]} exited with {process.returncode} before serving {address}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not serving after {timeout_s:.0f} s")


@dataclass
class Stack:
    """Processes started in order and stopped in reverse; usable as a context manager."""

    processes: list[subprocess.Popen] = field(default_factory=list)

    def start(self, module: str, port: int, args: list[str], timeout_s: float = 300, **popen) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), *args], **popen)
        self.processes.append(process)
        wait_healthy(f"127.0.0.1:{port}", process, timeout_s)
        return process

    def stop(self, timeout_s: float = 30) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.processes.clear()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


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
        stack.start("kvcached", 50052, [], process_group=0)
        stack.start("model_worker", 50053, ["--kvcached", "127.0.0.1:50052"], process_group=0)
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
