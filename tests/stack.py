"""Starting the real processes for end-to-end tests on free loopback ports, each logging to a file."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from radixserve.launch import Stack
from radixserve.v1 import kvcached_pb2, kvcached_pb2_grpc, router_pb2_grpc, worker_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
GRPCURL = str(Path(sys.executable).parent / "grpcurl")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Processes:
    """A `Stack` plus the log directory; each `start_*` returns the new service's address."""

    log_dir: Path
    stack: Stack = field(default_factory=Stack)

    def start(self, module: str, name: str, args: list[str]) -> str:
        port = free_port()
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self.stack.start(module, port, ["--metrics-port", "0", *args], stdout=log, stderr=subprocess.STDOUT,
                             cwd=REPO)
        return f"127.0.0.1:{port}"

    def kvcached(self, name: str = "kvcached", args: list[str] = ()) -> str:
        """A daemon with its own disk tier under the log directory (restarts with the same name find it)."""
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

    def stop(self) -> None:
        self.stack.stop()


def wait_for(condition, timeout_s: float = 20) -> bool:
    """Polls `condition()` until it holds (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def cached_blocks(kvcached: str) -> int:
    return sum(ns.blocks_cached for ns in kvcached_stats(kvcached).namespaces)


def router_stub(address: str) -> router_pb2_grpc.RouterStub:
    return router_pb2_grpc.RouterStub(grpc.insecure_channel(address))


def worker_stub(address: str) -> worker_pb2_grpc.WorkerStub:
    return worker_pb2_grpc.WorkerStub(grpc.insecure_channel(address))


def kvcached_stats(address: str) -> kvcached_pb2.KVCacheStats:
    return kvcached_pb2_grpc.KVCacheStub(grpc.insecure_channel(address)).GetStats(kvcached_pb2.GetStatsRequest(),
                                                                                  timeout=5)


@dataclass
class RunningStack:
    """kvcached, one worker and a router."""

    processes: Processes
    kvcached_address: str
    worker_address: str
    router_address: str

    def router(self) -> router_pb2_grpc.RouterStub:
        return router_stub(self.router_address)

    def worker(self) -> worker_pb2_grpc.WorkerStub:
        return worker_stub(self.worker_address)


def start_stack(log_dir: Path) -> RunningStack:
    processes = Processes(log_dir)
    try:
        kvcached = processes.kvcached()
        worker = processes.worker(kvcached)
        return RunningStack(processes, kvcached, worker, processes.router([worker], kvcached))
    except BaseException:
        processes.stop()
        raise
