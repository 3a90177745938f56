"""The model workers behind the router and how one is picked for a request."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from radixserve.blocks.keys import BlockHash
from radixserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("router.routing")

INFO_REFRESH_S = 1.0  # a worker restarted with another fingerprint gets leases of its namespace within this


class PrefixMemory:
    """The block keys of prompts recently sent to one worker: an approximation of what its L1 holds.

    Bounded LRU of keys. Keys are chained, so the prefix a worker holds is the run of leading keys present.
    """

    def __init__(self, capacity: int):
        self._keys: OrderedDict[BlockHash, None] = OrderedDict()
        self._capacity = capacity

    def matched(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self._keys:
            n += 1
        return n

    def remember(self, hashes: Sequence[BlockHash]) -> None:
        for key in hashes:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self._capacity:
            self._keys.popitem(last=False)


@dataclass(eq=False)
class WorkerHandle:
    address: str
    stub: worker_pb2_grpc.WorkerStub
    info: worker_pb2.WorkerInfo
    memory: PrefixMemory
    in_flight: int = field(default=0)


async def connect_worker(address: str, wait_s: float) -> WorkerHandle:
    """Opens a channel to `address` and waits up to `wait_s` for its GetInfo (the worker may still be loading)."""
    channel = grpc.aio.insecure_channel(address)
    stub = worker_pb2_grpc.WorkerStub(channel)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5, wait_for_ready=True)
            return WorkerHandle(address, stub, info, PrefixMemory(info.kv_pages_total))  # as many as its L1 holds
        except grpc.aio.AioRpcError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {address} did not come up within {wait_s:.0f} s: {e.details()}") from e
            await asyncio.sleep(0.5)


class WorkerPool:
    """Cache-aware, load-aware choice over workers serving one model.

    Among the workers whose load is within `load_slack` requests of the least loaded, the one that most likely holds
    the longest prefix of the prompt in its L1 wins (its `PrefixMemory`); then the least loaded; then the earliest
    listed. Without block keys (cache off) it is plain least-loaded.

    Routing keys are block keys under `routing_fingerprint`, the model's fingerprint at start: they only need to
    name prompt prefixes consistently. A worker's own fingerprint (`info`, kept fresh by `watch`) may change when it
    restarts with another dtype; its memory is forgotten then.
    """

    def __init__(self, workers: list[WorkerHandle], load_slack: int):
        fingerprints = {w.info.model.fingerprint for w in workers}
        if len(fingerprints) != 1:
            raise ValueError(f"workers serve different models: {sorted(fingerprints)}")
        self.workers = workers
        self.routing_fingerprint = fingerprints.pop()
        self._load_slack = load_slack

    @property
    def model(self):
        return self.workers[0].info.model

    def choose(self, hashes: Sequence[BlockHash]) -> WorkerHandle:
        least = min(w.in_flight for w in self.workers)
        candidates = [w for w in self.workers if w.in_flight <= least + self._load_slack]
        return max(candidates, key=lambda w: (w.memory.matched(hashes), -w.in_flight))

    def update(self, worker: WorkerHandle, info: worker_pb2.WorkerInfo) -> None:
        """Takes a worker's fresh `GetInfo`; a changed fingerprint (restarted with another model or dtype) makes the
        pool forget what the worker held."""
        if info.model.fingerprint != worker.info.model.fingerprint:
            log.warning("worker serves a new model fingerprint; forgetting what it held", extra={
                "worker": worker.address, "fingerprint": info.model.fingerprint,
                "was": worker.info.model.fingerprint})
            worker.memory = PrefixMemory(info.kv_pages_total)
        worker.info = info

    async def watch(self, interval_s: float = INFO_REFRESH_S) -> None:
        """Refreshes every worker's info each `interval_s`, until cancelled; an unreachable worker keeps its last."""
        while True:
            await asyncio.sleep(interval_s)
            for worker in self.workers:
                try:
                    self.update(worker, await worker.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=interval_s))
                except grpc.aio.AioRpcError:
                    pass

    @contextmanager
    def pick(self, hashes: Sequence[BlockHash] = ()) -> Iterator[WorkerHandle]:
        """`choose(hashes)`, counted as busy while the context is open and remembered to hold `hashes`."""
        worker = self.choose(hashes)
        worker.memory.remember(hashes)
        worker.in_flight += 1
        try:
            yield worker
        finally:
            worker.in_flight -= 1
