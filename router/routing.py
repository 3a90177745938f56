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
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixserve.blocks.keys import BlockHash
from radixserve.transport import TransportSecurity, open_aio_channel
from radixserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger("router.routing")

WATCH_RETRY_S = 0.5  # after a worker's health stream breaks, how soon to reconnect: a restart is back within it


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


class NoWorker(Exception):
    """No healthy worker is left to choose."""


@dataclass(eq=False)
class WorkerHandle:
    address: str
    stub: worker_pb2_grpc.WorkerStub
    info: worker_pb2.WorkerInfo
    memory: PrefixMemory
    health: health_pb2_grpc.HealthStub | None = None
    healthy: bool = True  # SERVING on its health stream, and no call failed since
    in_flight: int = field(default=0)


async def connect_worker(address: str, wait_s: float, security: TransportSecurity) -> WorkerHandle:
    """Opens a channel to `address` with `security` and waits up to `wait_s` for its GetInfo (the worker may still
    be loading)."""
    channel = open_aio_channel(address, security)
    stub = worker_pb2_grpc.WorkerStub(channel)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5, wait_for_ready=True)
            return WorkerHandle(address, stub, info, PrefixMemory(info.kv_pages_total),  # as many as its L1 holds
                                health_pb2_grpc.HealthStub(channel))
        except grpc.aio.AioRpcError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {address} did not come up within {wait_s:.0f} s: {e.details()}") from e
            await asyncio.sleep(0.5)


class WorkerPool:
    """Cache-aware, load-aware choice over workers serving one model.

    Among the workers whose load is within `load_slack` requests of the least loaded, the one that most likely holds
    the longest prefix of the prompt in its L1 wins (its `PrefixMemory`); then the least loaded; then the earliest
    listed. Without block keys (cache off) it is plain least-loaded.

    Only healthy workers are chosen. `watch` follows each worker's gRPC health stream: NOT_SERVING (draining) or a
    broken stream (dead, unreachable) takes it out at once, SERVING brings it back, and on every return its
    `GetInfo` is read again. A call that finds a worker unreachable takes it out too (`mark_failed`).

    Routing keys are block keys under `routing_fingerprint`, the model's fingerprint at start: they only need to
    name prompt prefixes consistently. A worker's own fingerprint (`info`) may change when it restarts with another
    dtype; its memory is forgotten then.
    """

    def __init__(self, workers: list[WorkerHandle], load_slack: int):
        fingerprints = {w.info.model.fingerprint for w in workers}
        if len(fingerprints) != 1:
            raise ValueError(f"workers serve different models or compute K/V differently: {sorted(fingerprints)}")
        self.workers = workers
        self.routing_fingerprint = fingerprints.pop()
        self._load_slack = load_slack

    @property
    def model(self):
        return self.workers[0].info.model

    @property
    def serving(self) -> bool:
        """Some worker can take a request."""
        return any(w.healthy for w in self.workers)

    def choose(self, hashes: Sequence[BlockHash], exclude: Sequence[WorkerHandle] = ()) -> WorkerHandle:
        """Raises NoWorker when no healthy worker outside `exclude` is left."""
        live = [w for w in self.workers if w.healthy and w not in exclude]
        if not live:
            raise NoWorker(f"no healthy model worker (of {len(self.workers)})")
        least = min(w.in_flight for w in live)
        candidates = [w for w in live if w.in_flight <= least + self._load_slack]
        return max(candidates, key=lambda w: (w.memory.matched(hashes), -w.in_flight))

    def mark_failed(self, worker: WorkerHandle) -> None:
        """A call found `worker` unreachable: no traffic until its health stream says SERVING again."""
        if worker.healthy:
            log.warning("worker unreachable; taking it out of rotation", extra={"worker": worker.address})
        worker.healthy = False

    def update(self, worker: WorkerHandle, info: worker_pb2.WorkerInfo) -> None:
        """Takes a worker's fresh `GetInfo`; a changed fingerprint (restarted with another model or dtype) makes the
        pool forget what the worker held."""
        if info.model.fingerprint != worker.info.model.fingerprint:
            log.warning("worker serves a new model fingerprint; forgetting what it held", extra={
                "worker": worker.address, "fingerprint": info.model.fingerprint,
                "was": worker.info.model.fingerprint})
            worker.memory = PrefixMemory(info.kv_pages_total)
        worker.info = info

    async def watch(self) -> None:
        """Follows every worker's health until cancelled (see the class docstring)."""
        await asyncio.gather(*(self._watch(worker) for worker in self.workers))

    async def _watch(self, worker: WorkerHandle) -> None:
        while True:
            call = worker.health.Watch(health_pb2.HealthCheckRequest())
            try:
                async for status in call:
                    if status.status != health_pb2.HealthCheckResponse.SERVING:
                        break  # draining: hang up, so the open stream does not hold its drain for the full grace
                    if not worker.healthy:
                        self.update(worker, await worker.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5))
                    self._set_healthy(worker, True)
            except grpc.aio.AioRpcError:
                pass
            finally:
                call.cancel()
            self._set_healthy(worker, False)  # not serving, gone or restarting: ask again shortly
            await asyncio.sleep(WATCH_RETRY_S)

    def _set_healthy(self, worker: WorkerHandle, healthy: bool) -> None:
        if healthy != worker.healthy:
            log.warning("worker back in rotation" if healthy else "worker out of rotation",
                        extra={"worker": worker.address})
        worker.healthy = healthy

    @contextmanager
    def pick(self, hashes: Sequence[BlockHash] = (), exclude: Sequence[WorkerHandle] = ()) -> Iterator[WorkerHandle]:
        """`choose(hashes, exclude)`, counted as busy while the context is open and remembered to hold `hashes`."""
        worker = self.choose(hashes, exclude)
        worker.memory.remember(hashes)
        worker.in_flight += 1
        try:
            yield worker
        finally:
            worker.in_flight -= 1
