"""gRPC glue for `radixserve.v1.KVCache`: `from_pb`/`to_pb` around `KVCache`, errors mapped to statuses."""

from __future__ import annotations

import asyncio
import functools
import inspect
import time

import grpc

from kvcached import metrics
from kvcached.cache import Conflict, Exhausted, InvalidRequest, KVCache, Namespace, NotFound
from kvcached.prefetch import Prefetcher
from radixserve import tracing
from radixserve.blocks.geometry import BlockGeometry
from radixserve.server import ServiceError
from radixserve.v1 import kvcache_pb2, kvcache_pb2_grpc

_STATUS = ((NotFound, grpc.StatusCode.NOT_FOUND), (Conflict, grpc.StatusCode.FAILED_PRECONDITION),
           (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT), (Exhausted, grpc.StatusCode.RESOURCE_EXHAUSTED))


def _rpc(fn):
    """Expires stale holds first, times the call (a span of the caller's trace, when it sent one), maps the core's
    errors to statuses."""
    name = f"kvcached.{fn.__name__}"

    @functools.wraps(fn)
    async def wrapper(self: KVCacheServicer, request, context):
        started = time.perf_counter()
        self.last_rpc_at = time.monotonic()
        metrics.expired.inc(self.cache.expire())
        try:
            with tracing.joined(name, context):
                result = fn(self, request)
                return await result if inspect.isawaitable(result) else result
        except tuple(e for e, _ in _STATUS) as e:
            code = next(c for cls, c in _STATUS if isinstance(e, cls))
            raise ServiceError(code, str(e.args[0])) from None
        finally:
            metrics.rpc_latency.labels(method=fn.__name__).observe(time.perf_counter() - started)
    return wrapper


def geometry_from_pb(pb) -> BlockGeometry:
    try:
        return BlockGeometry.from_pb(pb)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


def handle_to_pb(ns: Namespace) -> kvcache_pb2.PoolHandle:
    return kvcache_pb2.PoolHandle(model_fingerprint=ns.fingerprint, segment_name=ns.pool.name,
                                   slot_bytes=ns.geometry.block_bytes, num_slots=ns.pool.num_slots,
                                   geometry=ns.geometry.to_pb())


def disk_to_pb(cache: KVCache) -> kvcache_pb2.DiskStats:
    if cache.l3 is None:
        return kvcache_pb2.DiskStats(enabled=False)
    disk = cache.l3.disk.stats()
    return kvcache_pb2.DiskStats(enabled=True, healthy=disk.healthy, blocks=disk.blocks, bytes_used=disk.bytes_used,
                                  bytes_total=disk.bytes_total, corrupt_blocks=disk.corrupt_blocks)


class KVCacheServicer(kvcache_pb2_grpc.KVCacheServicer):
    def __init__(self, cache: KVCache, page_size: int, prefetcher: Prefetcher | None = None):
        """`prefetcher` None: no disk tier."""
        self.cache = cache
        self._page_size = page_size
        self._prefetcher = prefetcher
        self.last_rpc_at = time.monotonic()

    @_rpc
    def RegisterNamespace(self, request):
        return handle_to_pb(self.cache.register(request.model_fingerprint, geometry_from_pb(request.geometry)))

    @_rpc
    def MatchPrefix(self, request):
        ttl = request.lease_ttl_ms / 1e3 if request.lease_ttl_ms else None
        match = self.cache.match(request.model_fingerprint, request.cache_salt, request.token_ids, request.lease, ttl)
        metrics.match_queries.inc()
        metrics.query_tokens.inc(len(request.token_ids) // self._page_size * self._page_size)
        metrics.hit_tokens.labels(tier="l2").inc(match.pages * self._page_size)
        metrics.hit_tokens.labels(tier="l3").inc(match.l3_pages * self._page_size)
        prefetch_id = None
        if request.prefetch and self._prefetcher is not None:
            prefetch_id = self._prefetcher.maybe_start(request.model_fingerprint, request.cache_salt,
                                                       request.token_ids, match)
        tracing.annotate({"radixserve.l2_pages": match.pages, "radixserve.l3_pages": match.l3_pages,
                          "radixserve.prefetch_started": bool(prefetch_id)})
        return kvcache_pb2.MatchPrefixResponse(
            matched_pages=match.pages, l2_slots=match.l2_slots, l2_generations=match.generations,
            lease_expires_unix_ms=int(match.lease_expires_unix_s * 1e3), lease_id=match.lease_id or "",
            segment_name=self.cache.namespace(request.model_fingerprint).pool.name, l3_pages=match.l3_pages,
            prefetch_id=prefetch_id or "")

    @_rpc
    async def WaitPrefetch(self, request):
        if self._prefetcher is None:
            return kvcache_pb2.WaitPrefetchResponse(done=True)
        ready, total, done = await self._prefetcher.wait(request.prefetch_id, request.timeout_ms / 1e3,
                                                         request.cost_aware)
        tracing.annotate({"radixserve.prefetch.ready_pages": ready, "radixserve.prefetch.total_pages": total,
                          "radixserve.prefetch.done": done})
        return kvcache_pb2.WaitPrefetchResponse(ready_pages=ready, total_pages=total, done=done)

    @_rpc
    async def DropNamespace(self, request):
        if any(ns.fingerprint == request.model_fingerprint for ns in self.cache.namespaces()):
            raise Conflict(f"namespace {request.model_fingerprint[:12]} is registered; only stale ones are dropped")
        if self.cache.l3 is None:
            return kvcache_pb2.DropNamespaceResponse()
        dropped = await asyncio.to_thread(self.cache.l3.disk.delete_namespace, request.model_fingerprint)
        return kvcache_pb2.DropNamespaceResponse(dropped_blocks=dropped)

    @_rpc
    def AllocateSlots(self, request):
        allocation = self.cache.allocate(request.model_fingerprint, request.segment_name, request.count)
        metrics.evictions.labels(tier="l2").inc(allocation.evicted)
        return kvcache_pb2.AllocateSlotsResponse(allocation_id=allocation.allocation_id, slots=allocation.slots)

    @_rpc
    def CommitBlocks(self, request):
        commit = self.cache.commit(request.model_fingerprint, request.cache_salt, request.token_ids,
                                   request.first_page, request.slots, request.allocation_id)
        return kvcache_pb2.CommitBlocksResponse(inserted=commit.inserted, already_cached=commit.already_cached)

    @_rpc
    def ReleaseLease(self, request):
        self.cache.release(request.lease_id)
        return kvcache_pb2.ReleaseLeaseResponse()

    @_rpc
    def GetStats(self, request):
        return kvcache_pb2.KVCacheStats(disk=disk_to_pb(self.cache), namespaces=[
            kvcache_pb2.NamespaceStats(
                model_fingerprint=ns.fingerprint, segment_name=ns.pool.name, slots_total=ns.pool.num_slots,
                slots_free=ns.pool.num_free,
                blocks_cached=ns.index.total_pages, leases=self.cache.leases(ns),
                allocations=self.cache.allocations(ns))
            for ns in self.cache.namespaces()])
