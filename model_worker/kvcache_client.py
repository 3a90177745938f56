"""The worker's link to kvcached: registration, the attached L2 segment, lease releases and block commits.

Every RPC runs on the client's own thread, never on the engine loop or the gRPC event loop, with a deadline, so a
slow or dead kvcached costs the worker nothing but reuse. The job queue is bounded (`MAX_QUEUED_JOBS`): past it a
commit is dropped at once (its L1 pages unlocked, counted in `radixserve_worker_kvcached_dropped_jobs_total`) and a
release is left to the lease's TTL, so a frozen kvcached never holds L1 pages hostage. No exception ends the thread:
any job's failure is logged and counted. Failures are logged, counted
(`radixserve_worker_kvcached_errors_total`) and end that one job. A NOT_FOUND or an unknown pool (kvcached
restarted) drops the registration; the next job registers again, and an idle client re-registers every
`HEARTBEAT_S` (idempotent), so a restarted kvcached knows the namespace, and serves its disk tier, within a second.

The worker reads leased slots only from the segment its own registration returned: a lease naming any other segment
(a restarted kvcached the heartbeat has not seen yet, or a forged one) is not used, and it asks for a registration
at once.

Every allocation names the segment this worker registered, so after a kvcached restart no commit lands in a pool the
new daemon does not read (FAILED_PRECONDITION: the worker re-registers). A commit asks for at most
`MAX_COMMIT_SLOTS` slots at a time, below kvcached's cap on one allocation.

Threading contract: `l2_segment` is called by the engine thread; `release`/`commit` only enqueue. The L1 pages of a
commit job must stay unchanged until its `on_done` runs (the engine keeps them locked in its L1 index).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from model_worker import metrics
from model_worker.block_copy import HostBlockCopy, slab_blocks
from radixserve import tracing
from radixserve.blocks.geometry import BlockGeometry
from radixserve.blocks.slab import SlabSegment
from radixserve.transport import TransportSecurity, open_channel
from radixserve.v1 import kvcache_pb2, kvcache_pb2_grpc

log = logging.getLogger("model_worker.kvcache_client")

REGISTER_BACKOFF_S = 2.0  # after a failed registration, jobs skip kvcached this long instead of piling up calls
HEARTBEAT_S = 1.0  # an idle client re-registers this often: a restarted kvcached learns the namespace within it
MAX_QUEUED_JOBS = 256  # a frozen kvcached costs each commit its deadline: this bounds what waits meanwhile
MAX_COMMIT_SLOTS = 256  # slots per AllocateSlots: 4,096 tokens at page size 16, well under kvcached's default cap
# kvcached restarted or went away: forget its segment; the next registration attaches the new one.
_RETIRE_ON = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION)


@dataclass(frozen=True)
class CommitJob:
    """Pages [first_page, first_page + len(l1_pages)) of `token_ids` live in `l1_pages` of the worker's pool."""

    cache_salt: str
    token_ids: tuple[int, ...]
    first_page: int
    l1_pages: tuple[int, ...]
    on_done: Callable[[], None]
    trace: tuple[tuple[str, str], ...] = ()  # the request's trace context: the commit is a span of its trace


@dataclass
class Attached:
    """The registered namespace's L2 segment, and its slots as blocks."""

    segment: SlabSegment
    blocks: torch.Tensor | None  # [num_slots, *block shape], a view of the shared memory; None once retired


class KVCacheClient:
    def __init__(self, address: str, security: TransportSecurity, fingerprint: str, geometry: BlockGeometry,
                 l1_kv: torch.Tensor, timeout_s: float, block_copy: HostBlockCopy):
        """`l1_kv` is the worker's page-first pool tensor; a block is one `l1_kv[page]`, moved by `block_copy`."""
        self._block_copy = block_copy
        self._stub = kvcache_pb2_grpc.KVCacheStub(open_channel(address, security))
        self._address = address
        self._fingerprint = fingerprint
        self._geometry = geometry
        self._l1_kv = l1_kv
        self._timeout_s = timeout_s
        self._attached: Attached | None = None
        self._attach_lock = threading.Lock()
        self._retired: list[Attached] = []
        self._retry_at = 0.0
        self._register_queued = False  # one queued registration is enough, however many stale leases ask
        self._reachable = True  # False after a failure until a registration succeeds
        self._mapped_once = False  # the first attached segment was populated (`_attach`)
        self._jobs: queue.Queue = queue.Queue(MAX_QUEUED_JOBS)
        self._thread = threading.Thread(target=self._run, name="kvcache-client", daemon=True)
        self._thread.start()
        self._register_soon()  # attach early: the first request may already hit L2

    # -- engine side -------------------------------------------------------------------------------------------
    @property
    def segment_name(self) -> str:
        """The registered namespace's L2 segment; empty while unregistered."""
        attached = self._attached
        return attached.segment.name if attached is not None else ""

    def l2_segment(self, segment_name: str) -> Attached | None:
        """The registered segment, when `segment_name` is that segment; else None, and a registration is queued
        (kvcached may have restarted)."""
        attached = self._attached
        if attached is not None and attached.segment.name == segment_name:
            return attached
        log.info("lease names a segment this worker is not registered with; recomputing",
                 extra={"segment": segment_name, "registered": self.segment_name})
        self._register_soon()
        return None

    def release(self, lease_id: str) -> None:
        self._enqueue(("release", functools.partial(self._release, lease_id), None))

    def commit(self, job: CommitJob) -> None:
        self._enqueue(("commit", functools.partial(self._commit, job), job.on_done))

    def close(self) -> None:
        """Sends what is queued, stops the thread and unmaps the segment (the engine must be stopped first)."""
        self._jobs.put(None)
        self._thread.join()
        self._retire()

    # -- client thread -----------------------------------------------------------------------------------------
    def _register_soon(self) -> None:
        if not self._register_queued:
            self._register_queued = True
            self._enqueue(("register", self.register, None))

    def _enqueue(self, job: tuple) -> None:
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            op, _, on_done = job
            metrics.kvcached_dropped_jobs.labels(op=op).inc()
            if op == "register":
                self._register_queued = False
            if on_done is not None:
                on_done()

    def register(self) -> bool:
        """Registers the namespace and attaches its segment; False (and logged) when kvcached is unreachable."""
        self._register_queued = False
        request = kvcache_pb2.RegisterNamespaceRequest(model_fingerprint=self._fingerprint,
                                                        geometry=self._geometry.to_pb())
        try:
            handle = self._stub.RegisterNamespace(request, timeout=self._timeout_s)
        except grpc.RpcError as e:
            self._failed("register", e)
            self._retry_at = time.monotonic() + REGISTER_BACKOFF_S
            return False
        self._reachable = True
        if handle.segment_name != self.segment_name:
            self._attach(handle.segment_name, handle.num_slots)
            log.info("Radix cache enabled", extra={"kvcached": self._address, "segment": handle.segment_name,
                                                   "capacity_blocks": handle.num_slots})
        with self._attach_lock:
            self._close_retired()
        return True

    def _attach(self, segment_name: str, num_slots: int) -> None:
        # The first segment's pages are mapped in (`populate`) once it is attached, on this thread, at start-up (hits
        # may copy meanwhile; commits queue behind it). A commit writes its blocks through this mapping, and a write
        # faults one 4 KiB page at a time (reads fault in 16): 16 blocks (11.8 MB) took 4-5.5 ms of CPU beside the
        # forward into slots not yet touched, 0.7 ms once mapped (1 GiB took 0.7 s). A later segment (kvcached
        # restarted) faults in as it is used: populating a restarted kvcached's 1.5 GB segment took 0.5 s of CPU beside
        # the first hits (a 74 MB copy out of an unmapped range took 23 instead of 19 ms; docs/design.md section 9).
        segment = SlabSegment.attach(segment_name, self._geometry.block_bytes, num_slots)
        blocks = slab_blocks(segment, self._geometry)
        self._block_copy.pin(blocks)
        self._retire()
        self._attached = Attached(segment, blocks)
        if not self._mapped_once:
            self._mapped_once = True
            segment.populate()

    def _retire(self) -> None:
        """Forgets the attached segment; it is unmapped once no copy reads it (`_close_retired`)."""
        with self._attach_lock:
            if self._attached is not None:
                self._retired.append(self._attached)
                self._attached = None
            self._close_retired()

    def _close_retired(self) -> None:
        """Unmaps segments of a previous kvcached (their memory is freed only once unmapped). A copy still reading
        one keeps it mapped until a later call. Call with `_attach_lock` held."""
        for old in list(self._retired):
            if old.blocks is not None:
                self._block_copy.unpin(old.blocks)
            old.blocks = None
            try:
                old.segment.close()
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
            except Exception:  # the thread must outlive any job: a dead one would leave commits locked forever
                log.exception("kvcached job failed", extra={"op": op})
                metrics.kvcached_errors.labels(op=op).inc()
            finally:
                if on_done is not None:
                    on_done()

    def _release(self, lease_id: str) -> None:
        self._stub.ReleaseLease(kvcache_pb2.ReleaseLeaseRequest(lease_id=lease_id), timeout=self._timeout_s)

    def _commit(self, job: CommitJob) -> None:
        if self._attached is None and (time.monotonic() < self._retry_at or not self.register()):
            return
        with tracing.span("worker.commit", tracing.extract(job.trace), attributes={
                "radixserve.commit.first_page": job.first_page, "radixserve.commit.pages": len(job.l1_pages)}):
            self._commit_pages(job, tracing.outgoing())

    def _commit_pages(self, job: CommitJob, metadata: tuple[tuple[str, str], ...] | None) -> None:
        attached = self._attached
        for start in range(0, len(job.l1_pages), MAX_COMMIT_SLOTS):
            pages = job.l1_pages[start:start + MAX_COMMIT_SLOTS]
            allocation = self._stub.AllocateSlots(kvcache_pb2.AllocateSlotsRequest(
                model_fingerprint=self._fingerprint, count=len(pages), segment_name=attached.segment.name),
                timeout=self._timeout_s, metadata=metadata)
            for slot, page in zip(allocation.slots, pages):
                self._block_copy.copy(attached.blocks[slot], self._l1_kv[page])
            self._block_copy.drain()
            first_page = job.first_page + start
            result = self._stub.CommitBlocks(kvcache_pb2.CommitBlocksRequest(
                model_fingerprint=self._fingerprint, cache_salt=job.cache_salt,
                token_ids=job.token_ids[:(first_page + len(pages)) * self._geometry.page_size],
                first_page=first_page, slots=allocation.slots, allocation_id=allocation.allocation_id),
                timeout=self._timeout_s, metadata=metadata)
            metrics.committed_blocks.inc(result.inserted)
            if len(allocation.slots) < len(pages):  # L2 is full of pinned pages: the rest would leave a gap
                return

    def _failed(self, op: str, e: grpc.RpcError) -> None:
        metrics.kvcached_errors.labels(op=op).inc()
        if self._reachable:  # one line per outage, not one per heartbeat
            log.warning("kvcached call failed; continuing without it", extra={
                "op": op, "kvcached": self._address, "code": e.code().name, "details": e.details()})
        self._reachable = e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        if e.code() in _RETIRE_ON and op != "release":
            self._retire()
