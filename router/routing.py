"""The model workers behind the router and how one is picked for a request."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from radixserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("router.routing")


@dataclass(eq=False)
class WorkerHandle:
    address: str
    stub: worker_pb2_grpc.WorkerStub
    info: worker_pb2.WorkerInfo
    in_flight: int = field(default=0)


async def connect_worker(address: str, wait_s: float) -> WorkerHandle:
    """Opens a channel to `address` and waits up to `wait_s` for its GetInfo (the worker may still be loading)."""
    channel = grpc.aio.insecure_channel(address)
    stub = worker_pb2_grpc.WorkerStub(channel)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5, wait_for_ready=True)
            return WorkerHandle(address, stub, info)
        except grpc.aio.AioRpcError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {address} did not come up within {wait_s:.0f} s: {e.details()}") from e
            await asyncio.sleep(0.5)


class WorkerPool:
    """Least-loaded choice over workers serving one model; ties go to the earliest listed worker."""

    def __init__(self, workers: list[WorkerHandle]):
        fingerprints = {w.info.model.fingerprint for w in workers}
        if len(fingerprints) != 1:
            raise ValueError(f"workers serve different models: {sorted(fingerprints)}")
        self.workers = workers

    @property
    def model(self):
        return self.workers[0].info.model

    @contextmanager
    def pick(self) -> Iterator[WorkerHandle]:
        """The worker with the fewest requests in flight, counted as busy while the context is open."""
        worker = min(self.workers, key=lambda w: w.in_flight)
        worker.in_flight += 1
        try:
            yield worker
        finally:
            worker.in_flight -= 1

    def in_flight(self) -> int:
        return sum(w.in_flight for w in self.workers)
