"""End-to-end test helpers over `radixserve.launch.LocalServices`: stubs, stats, one started stack, test prompts."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc

from radixserve.blocks.slab import SHM_DIR, segment_pid
from radixserve.launch import LocalServices, free_port
from radixserve.v1 import kvcache_pb2, kvcache_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2_grpc

GRPCURL = str(Path(sys.executable).parent / "grpcurl")

PAGE = 16  # the services' default page size
GREEDY = router_pb2.SamplingParams(temperature=0, max_new_tokens=12)
SENTENCES = ["The river bends twice before it reaches the old mill.", "Every lamp in the square was lit at dusk.",
             "A ledger of harvests lay open on the table.", "Wind from the north carried the smell of salt.",
             "The clockmaker repaired the tower bell in spring.", "Children counted boats from the harbour wall."]


def document(seed: int, sentences: int = 40) -> str:
    """A distinct document per seed: the record number comes first, so no two seeds share a cached page."""
    picks = (SENTENCES[(seed * 7 + i * (seed + 1)) % len(SENTENCES)] for i in range(sentences))
    return f"Record {seed}. " + " ".join(picks)


def ask(doc: str, question: str) -> list[router_pb2.ChatMessage]:
    return [router_pb2.ChatMessage(role="system", content="Answer from this document.\n" + doc),
            router_pb2.ChatMessage(role="user", content=question)]


def generate(router: str, messages) -> router_pb2.GenerateResponse:
    """One greedy, unstreamed answer."""
    (response,) = router_stub(router).Generate(router_pb2.GenerateRequest(messages=messages, sampling=GREEDY),
                                               timeout=120)
    return response


def segments_of(pids: set[int]) -> set[str]:
    """The shared-memory segments in /dev/shm that processes `pids` created."""
    return {name for name in os.listdir(SHM_DIR) if segment_pid(name) in pids}


def cached_blocks(kvcached: str) -> int:
    return sum(ns.blocks_cached for ns in kvcached_stats(kvcached).namespaces)


def router_stub(address: str) -> router_pb2_grpc.RouterStub:
    return router_pb2_grpc.RouterStub(grpc.insecure_channel(address))


def worker_stub(address: str) -> worker_pb2_grpc.WorkerStub:
    return worker_pb2_grpc.WorkerStub(grpc.insecure_channel(address))


def kvcached_stats(address: str) -> kvcache_pb2.KVCacheStats:
    return kvcache_pb2_grpc.KVCacheStub(grpc.insecure_channel(address)).GetStats(kvcache_pb2.GetStatsRequest(),
                                                                                  timeout=5)


@dataclass
class RunningStack:
    """kvcached, one worker and a router, with its HTTP API at `http_url`."""

    services: LocalServices
    kvcached_address: str
    worker_address: str
    router_address: str
    http_url: str

    def router(self) -> router_pb2_grpc.RouterStub:
        return router_stub(self.router_address)

    def worker(self) -> worker_pb2_grpc.WorkerStub:
        return worker_stub(self.worker_address)


def start_stack(log_dir: Path, router_args: list[str] = (), worker_args: list[str] = ()) -> RunningStack:
    services = LocalServices(log_dir)
    try:
        kvcached = services.kvcached()
        worker = services.worker(kvcached, args=worker_args)
        http_port = free_port()
        router = services.router([worker], kvcached, args=router_args, http_port=http_port)
        return RunningStack(services, kvcached, worker, router, f"http://127.0.0.1:{http_port}")
    except BaseException:
        services.stop()
        raise
