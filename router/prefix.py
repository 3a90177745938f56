"""The router's view of kvcached: match a prompt's cached prefix, wait for its disk part per the prefetch policy,
and lease what is in L2 for the worker.

    MatchPrefix(lease, prefetch) ──► L3 pages and a prefetch running? ──► wait per policy ──► MatchPrefix(lease) again
                                     no ─► dispatch with the L2 lease        wait_complete: until loaded (or deadline)
                                                                              timeout: up to --prefetch-timeout-ms,
                                                                              then on while the rest loads sooner
                                                                              than it recomputes (cost-aware)
                                                                              best_effort: not at all

Each request waits on its own, so a request without disk pages never queues behind one that has them.
kvcached is an accelerator, never a dependency: any failure or a missed deadline yields "no match", a log line and
`radixserve_kvcached_errors_total`, and the request is recomputed. gRPC channels reconnect on their own, so reuse
resumes when kvcached comes back.

Leases: the first match's lease is released once the second one is taken, also when the request is cancelled while
it waits; `release_soon` releases a lease the worker never got (its call failed or was cancelled before it answered).
A lease is matched in the namespace of the worker that will copy it (its fingerprint), so a worker restarted with
another model or dtype gets leases of its own namespace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from radixserve import tracing
from radixserve.transport import TransportSecurity, open_aio_channel
from radixserve.v1 import kvcache_pb2, kvcache_pb2_grpc, worker_pb2
from router import metrics
from router.config import PrefetchPolicy

log = logging.getLogger("router.prefix")

WAIT_COMPLETE_CAP_S = 60.0  # wait_complete without a client deadline still ends (a prefetch's reads have timeouts)


@dataclass(frozen=True)
class Reuse:
    """What a request may reuse: the L2 lease, which of its pages were loaded from L3 for it, and the wait."""

    lease: worker_pb2.L2Lease | None
    l3_pages: range = range(0)  # page indices loaded from L3 into L2 while this request waited
    prefetch_wait_s: float = 0.0


class PrefixMatcher:
    def __init__(self, address: str, security: TransportSecurity, timeout_s: float, lease_ttl_ms: int,
                 policy: PrefetchPolicy, prefetch_timeout_s: float, model: str):
        """`model` labels the metrics."""
        self._series = metrics.of(model)
        self._stub = kvcache_pb2_grpc.KVCacheStub(open_aio_channel(address, security))
        self._address = address
        self._releases: set[asyncio.Task] = set()  # in flight; a reference keeps each task alive
        self._timeout_s = timeout_s
        self._lease_ttl_ms = lease_ttl_ms
        self._policy = policy
        self._prefetch_timeout_s = prefetch_timeout_s

    async def reuse(self, fingerprint: str, token_ids: list[int], cache_salt: str, deadline_s: float | None) -> Reuse:
        """The reusable prefix of `token_ids` in namespace `fingerprint`; `deadline_s` is the client's remaining
        time (None: no deadline). With tracing on, the match and the prefetch wait are spans of the current trace."""
        with tracing.span("router.prefix_match") as span:
            first = await self._match(fingerprint, token_ids, cache_salt, prefetch=True)
            if first is not None:
                span.set_attributes({"radixserve.l2_pages": first.matched_pages, "radixserve.l3_pages": first.l3_pages,
                                     "radixserve.prefetch_started": bool(first.prefetch_id)})
        if first is None:
            return Reuse(None)
        if not first.prefetch_id or self._policy is PrefetchPolicy.BEST_EFFORT:
            self._count_prefetch(first.l3_pages, loaded=0)
            return Reuse(_lease(first))
        with tracing.span("router.prefetch_wait", attributes={"radixserve.prefetch.policy": str(self._policy),
                                                               "radixserve.l3_pages": first.l3_pages}) as span:
            started = time.monotonic()
            try:
                await self._wait(first.prefetch_id, self._wait_budget(deadline_s), deadline_s)
            finally:  # also when the client gives up while it waits
                self.release_soon(first.lease_id)
            waited = time.monotonic() - started
            self._series.prefetch_wait_time.observe(waited)
            second = await self._match(fingerprint, token_ids, cache_salt, prefetch=False)
            loaded = 0 if second is None else max(0, second.matched_pages - first.matched_pages)
            span.set_attributes({"radixserve.prefetch.pages_loaded": loaded,
                                 "radixserve.prefetch.wait_ms": waited * 1e3})
        if second is None:
            return Reuse(None, prefetch_wait_s=waited)
        self._count_prefetch(first.l3_pages, loaded)
        return Reuse(_lease(second), range(first.matched_pages, first.matched_pages + loaded), waited)

    def _wait_budget(self, deadline_s: float | None) -> float:
        if self._policy is PrefetchPolicy.TIMEOUT:
            return self._prefetch_timeout_s
        return _capped(deadline_s)

    def _count_prefetch(self, l3_pages: int, loaded: int) -> None:
        if l3_pages:
            (self._series.prefetch_hit if loaded >= l3_pages else self._series.prefetch_miss).inc()

    def release_soon(self, lease_id: str) -> None:
        """Releases `lease_id` (nothing when empty) on its own task, so a cancelled request still releases it; a
        lease already released (the worker got there first) is fine."""
        if lease_id:
            task = asyncio.get_running_loop().create_task(self._release(lease_id))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    async def _match(self, fingerprint: str, token_ids: list[int], cache_salt: str, prefetch: bool
                     ) -> kvcache_pb2.MatchPrefixResponse | None:
        request = kvcache_pb2.MatchPrefixRequest(model_fingerprint=fingerprint, cache_salt=cache_salt,
                                                  token_ids=token_ids, lease=True, lease_ttl_ms=self._lease_ttl_ms,
                                                  prefetch=prefetch)
        return await self._call("match", self._stub.MatchPrefix, request, self._timeout_s)

    async def _wait(self, prefetch_id: str, budget_s: float, deadline_s: float | None) -> None:
        """Waits for the prefetch: `budget_s`, and under the `timeout` policy on past it while kvcached predicts the
        rest loads sooner than it would recompute (cost-aware), within the client's `deadline_s`."""
        self._series.prefetch_queue_size.inc()
        cost_aware = self._policy is PrefetchPolicy.TIMEOUT
        call_s = _capped(deadline_s) if cost_aware else budget_s + self._timeout_s
        try:
            request = kvcache_pb2.WaitPrefetchRequest(prefetch_id=prefetch_id, timeout_ms=int(budget_s * 1e3),
                                                      cost_aware=cost_aware)
            await self._call("wait_prefetch", self._stub.WaitPrefetch, request, call_s)
        finally:
            self._series.prefetch_queue_size.dec()

    async def _release(self, lease_id: str) -> None:
        await self._call("release", self._stub.ReleaseLease, kvcache_pb2.ReleaseLeaseRequest(lease_id=lease_id),
                         self._timeout_s, expected=grpc.StatusCode.NOT_FOUND)

    async def _call(self, op: str, method, request, timeout_s: float, expected: grpc.StatusCode | None = None):
        """`method(request)`, or None after a failure; `expected` is a status that is no failure (None back)."""
        try:
            return await method(request, timeout=timeout_s, metadata=tracing.outgoing())
        except grpc.aio.AioRpcError as e:
            if e.code() == expected:
                return None
            self._series.kvcached_errors(op).inc()
            log.warning("kvcached call failed; recomputing what it would have served",
                        extra={"op": op, "kvcached": self._address, "code": e.code().name, "details": e.details()})
            return None


def _capped(deadline_s: float | None) -> float:
    """The client's remaining time, at most `WAIT_COMPLETE_CAP_S`."""
    return min(deadline_s, WAIT_COMPLETE_CAP_S) if deadline_s is not None else WAIT_COMPLETE_CAP_S


def _lease(match: kvcache_pb2.MatchPrefixResponse) -> worker_pb2.L2Lease | None:
    if not match.lease_id:
        return None
    return worker_pb2.L2Lease(lease_id=match.lease_id, segment_name=match.segment_name, slots=match.l2_slots,
                              generations=match.l2_generations, expires_unix_ms=match.lease_expires_unix_ms)
