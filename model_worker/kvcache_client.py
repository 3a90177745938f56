"""The worker's link to kvcached: registration, the attached L2 pool, lease releases and block commits.

Every RPC runs on the client's own thread, never on the engine loop or the gRPC event loop, with a deadline, so a
slow or dead kvcached costs the worker nothing but reuse. Failures are logged, counted
(`radixserve_worker_kvcached_errors_total`) and end that one job. A NOT_FOUND or an unknown pool (kvcached
restarted) drops the registration; the next job registers again, and an idle client re-registers every
`HEARTBEAT_S` (idempotent), so a restarted kvcached knows the namespace, and serves its disk tier, within a second.

Threading contract: `l2_slots_view` is called by the engine thread; `release`/`commit` only enqueue. The L1 pages
of a commit job must stay unchanged until its `on_done` runs (the engine keeps them locked in its L1 index).
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch
from prometheus_client import Counter

from kvcached.tiers.dram_shm import SEGMENT_PREFIX, SHM_DIR, SlabPool
from model_worker.block_copy import HostBlockCopy
from radixserve.v1 import kvcached_pb2, kvcached_pb2_grpc

log = logging.getLogger("model_worker.kvcache_client")

errors = Counter("radixserve_worker_kvcached_errors_total", "kvcached calls that failed", ["op"])
committed_blocks = Counter("radixserve_worker_committed_blocks_total", "Blocks committed to kvcached")

REGISTER_BACKOFF_S = 2.0  # after a failed registration, jobs skip kvcached this long instead of piling up calls
HEARTBEAT_S = 1.0  # an idle client re-registers this often: a restarted kvcached learns the namespace within it


@dataclass(frozen=True)
class CommitJob:
    """Pages [first_page, first_page + len(l1_pages)) of `token_ids` live in `l1_pages` of the worker's pool."""

    cache_salt: str
    token_ids: tuple[int, ...]
    first_page: int
    l1_pages: tuple[int, ...]
    on_done: Callable[[], None]


@dataclass
class _Attached:
    segment_name: str
    pool: SlabPool
    slots: torch.Tensor | None  # [num_slots, *block shape], a view of the shared memory; None once retired


class KVCacheClient:
    def __init__(self, address: str, fingerprint: str, geometry: kvcached_pb2.BlockGeometry, l1_kv: torch.Tensor,
                 timeout_s: float, block_copy: HostBlockCopy):
        """`l1_kv` is the worker's page-first pool tensor; a block is one `l1_kv[page]`, moved by `block_copy`."""
        self._block_copy = block_copy
        self._stub = kvcached_pb2_grpc.KVCacheStub(grpc.insecure_channel(address))
        self._address = address
        self._fingerprint = fingerprint
        self._geometry = geometry
        self._l1_kv = l1_kv
        self._timeout_s = timeout_s
        self._attached: _Attached | None = None
        self._attach_lock = threading.RLock()
        self._retired: list[_Attached] = []
        self._block_bytes = l1_kv[0].numel() * l1_kv.element_size()
        self._retry_at = 0.0
        self._reachable = True  # False after a failure until a registration succeeds
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvcache-client", daemon=True)
        self._thread.start()
        self._jobs.put(("register", self.register, None))  # attach early: the first request may already hit L2

    # -- engine side -------------------------------------------------------------------------------------------
    def l2_slots_view(self, segment_name: str) -> torch.Tensor | None:
        """The slots of pool `segment_name` as blocks, attaching it first if it is new (kvcached restarted and the
        heartbeat has not re-registered yet); None when it cannot be attached."""
        attached = self._attached
        if attached is not None and attached.segment_name == segment_name:
            return attached.slots
        if not segment_name.startswith(SEGMENT_PREFIX) or "/" in segment_name:
            log.warning("lease names a segment that is not kvcached's; ignoring it", extra={"segment": segment_name})
            return None
        try:
            num_slots = os.stat(os.path.join(SHM_DIR, segment_name)).st_size // self._block_bytes
            return self._attach(segment_name, num_slots).slots
        except (OSError, ValueError) as e:
            log.warning("cannot attach the leased pool; recomputing", extra={"segment": segment_name, "error": str(e)})
            return None

    def release(self, lease_id: str) -> None:
        self._jobs.put(("release", functools.partial(self._release, lease_id), None))

    def commit(self, job: CommitJob) -> None:
        self._jobs.put(("commit", functools.partial(self._commit, job), job.on_done))

    def close(self) -> None:
        """Sends what is queued, stops the thread and unmaps the pool (the engine must be stopped first)."""
        self._jobs.put(None)
        self._thread.join()
        with self._attach_lock:
            if self._attached is not None:
                self._retired.append(self._attached)
                self._attached = None
            self._close_retired()

    # -- client thread -----------------------------------------------------------------------------------------
    def register(self) -> bool:
        """Registers the namespace and attaches its pool; False (and logged) when kvcached is unreachable."""
        request = kvcached_pb2.RegisterNamespaceRequest(model_fingerprint=self._fingerprint, geometry=self._geometry)
        try:
            handle = self._stub.RegisterNamespace(request, timeout=self._timeout_s)
        except grpc.RpcError as e:
            self._failed("register", e)
            self._retry_at = time.monotonic() + REGISTER_BACKOFF_S
            return False
        self._reachable = True
        with self._attach_lock:
            self._close_retired()
        if self._attached is None or self._attached.segment_name != handle.segment_name:
            self._attach(handle.segment_name, handle.num_slots)
            log.info(f"Radix cache enabled, capacity {handle.num_slots} blocks in kvcached L2",
                     extra={"kvcached": self._address, "segment": handle.segment_name})
        return True

    def _attach(self, segment_name: str, num_slots: int) -> _Attached:
        """Maps pool `segment_name` (called by the engine thread or the client thread, hence the lock)."""
        with self._attach_lock:
            if self._attached is not None and self._attached.segment_name == segment_name:
                return self._attached
            pool = SlabPool.attach(segment_name, self._block_bytes, num_slots)
            slots = torch.frombuffer(pool.buffer, dtype=self._l1_kv.dtype).view(num_slots, *self._l1_kv.shape[1:])
            self._block_copy.pin(slots)
            if self._attached is not None:
                self._retired.append(self._attached)
            self._attached = _Attached(segment_name, pool, slots)
            self._close_retired()
            return self._attached

    def _close_retired(self) -> None:
        """Unmaps pools of a previous kvcached (their memory is freed only once unmapped). A copy still reading
        one keeps it mapped until a later call."""
        for old in list(self._retired):
            if old.slots is not None:
                self._block_copy.unpin(old.slots)
            old.slots = None
            try:
                old.pool.close()
                self._retired.remove(old)
            except BufferError:
                pass

    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                job = ("register", self.register, None)
            if job is None:
                return
            op, run, on_done = job
            try:
                run()
            except grpc.RpcError as e:
                self._failed(op, e)
            finally:
                if on_done is not None:
                    on_done()

    def _release(self, lease_id: str) -> None:
        self._stub.ReleaseLease(kvcached_pb2.ReleaseLeaseRequest(lease_id=lease_id), timeout=self._timeout_s)

    def _commit(self, job: CommitJob) -> None:
        if self._attached is None and (time.monotonic() < self._retry_at or not self.register()):
            return
        slots_view = self._attached.slots
        allocation = self._stub.AllocateSlots(kvcached_pb2.AllocateSlotsRequest(
            model_fingerprint=self._fingerprint, count=len(job.l1_pages)), timeout=self._timeout_s)
        for slot, page in zip(allocation.slots, job.l1_pages):
            self._block_copy.copy(slots_view[slot], self._l1_kv[page])
        self._block_copy.drain()
        result = self._stub.CommitBlocks(kvcached_pb2.CommitBlocksRequest(
            model_fingerprint=self._fingerprint, cache_salt=job.cache_salt, token_ids=job.token_ids,
            first_page=job.first_page, slots=allocation.slots, allocation_id=allocation.allocation_id),
            timeout=self._timeout_s)
        committed_blocks.inc(result.inserted)

    def _failed(self, op: str, e: grpc.RpcError) -> None:
        errors.labels(op=op).inc()
        if self._reachable:  # one line per outage, not one per heartbeat
            log.warning("kvcached call failed; continuing without it", extra={
                "op": op, "kvcached": self._address, "code": e.code().name, "details": e.details()})
        self._reachable = e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE) and op != "release":
            # kvcached restarted or went away: forget its pool; the next registration attaches the new one.
            with self._attach_lock:
                if self._attached is not None:
                    self._retired.append(self._attached)
                    self._attached = None
                self._close_retired()
