"""Starting the real processes for end-to-end tests: free loopback ports, one worker per test module by default."""

from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import grpc

from radixserve.launch import Stack
from radixserve.v1 import router_pb2_grpc, worker_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
GRPCURL = str(Path(__import__("sys").executable).parent / "grpcurl")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningStack:
    stack: Stack
    router_address: str
    worker_address: str

    def router(self) -> router_pb2_grpc.RouterStub:
        return router_pb2_grpc.RouterStub(grpc.insecure_channel(self.router_address))

    def worker(self) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(grpc.insecure_channel(self.worker_address))


def start_stack(log_dir: Path, worker_args: list[str] = (), router_args: list[str] = ()) -> RunningStack:
    """A worker and a router on free ports, logging to files in `log_dir`; stop with `.stack.stop()`."""
    stack = Stack()
    worker_port, router_port = free_port(), free_port()
    try:
        for module, port, args in (("model_worker", worker_port, ["--metrics-port", "0", *worker_args]),
                                   ("router", router_port, ["--metrics-port", "0", "--worker",
                                                            f"127.0.0.1:{worker_port}", *router_args])):
            with open(log_dir / f"{module}.log", "ab") as log:
                stack.start(module, port, args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    except BaseException:
        stack.stop()
        raise
    return RunningStack(stack, f"127.0.0.1:{router_port}", f"127.0.0.1:{worker_port}")
