"""gRPC glue for `radixserve.v1.KVCache`: `from_pb`/`to_pb` around `KVCache`, errors mapped to statuses."""

from __future__ import annotations

import functools
import time

import grpc

from kvcached import metrics
from kvcached.cache import Conflict, Exhausted, Geometry, InvalidRequest, KVCache, Namespace, NotFound
from radixserve.server import ServiceError
from radixserve.v1 import kvcached_pb2, kvcached_pb2_grpc

_STATUS = ((NotFound, grpc.StatusCode.NOT_FOUND), (Conflict, grpc.StatusCode.FAILED_PRECONDITION),
           (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT), (Exhausted, grpc.StatusCode.RESOURCE_EXHAUSTED))


def _rpc(fn):
    """Expires stale holds first, times the call, maps the core's errors to statuses, refreshes the gauges."""
    @functools.wraps(fn)
    async def wrapper(self: KVCacheServicer, request, context):
        started = time.perf_counter()
        metrics.expired.inc(self.cache.expire())
        try:
            return fn(self, request)
        except tuple(e for e, _ in _STATUS) as e:
            code = next(c for cls, c in _STATUS if isinstance(e, cls))
            raise ServiceError(code, str(e.args[0])) from None
        finally:
            refresh_gauges(self.cache)
            metrics.rpc_latency.labels(method=fn.__name__).observe(time.perf_counter() - started)
    return wrapper


def geometry_from_pb(g: kvcached_pb2.BlockGeometry) -> Geometry:
    return Geometry(g.num_layers, g.num_kv_heads, g.head_dim, g.page_size, g.dtype, g.layout)


def handle_to_pb(ns: Namespace) -> kvcached_pb2.PoolHandle:
    g = ns.geometry
    return kvcached_pb2.PoolHandle(
        model_fingerprint=ns.fingerprint, segment_name=ns.pool.name, slot_bytes=g.block_bytes,
        num_slots=ns.pool.num_slots, geometry=kvcached_pb2.BlockGeometry(
            num_layers=g.num_layers, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim, page_size=g.page_size,
            dtype=g.dtype, layout=g.layout))


def refresh_gauges(cache: KVCache) -> None:
    total = sum(ns.pool.num_slots for ns in cache.namespaces())
    cached = sum(ns.index.total_pages for ns in cache.namespaces())
    block_bytes = {ns.fingerprint: ns.geometry.block_bytes for ns in cache.namespaces()}
    metrics.blocks.labels(tier="l2", state="total").set(total)
    metrics.blocks.labels(tier="l2", state="cached").set(cached)
    metrics.bytes_.labels(tier="l2", state="total").set(
        sum(ns.pool.num_slots * block_bytes[ns.fingerprint] for ns in cache.namespaces()))
    metrics.bytes_.labels(tier="l2", state="cached").set(
        sum(ns.index.total_pages * block_bytes[ns.fingerprint] for ns in cache.namespaces()))
    metrics.leases.set(cache.leases())


class KVCacheServicer(kvcached_pb2_grpc.KVCacheServicer):
    def __init__(self, cache: KVCache, page_size: int):
        self.cache = cache
        self._page_size = page_size

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
        return kvcached_pb2.MatchPrefixResponse(
            matched_pages=match.pages, l2_slots=match.l2_slots, lease_id=match.lease_id or "",
            segment_name=self.cache.namespace(request.model_fingerprint).pool.name)

    @_rpc
    def AllocateSlots(self, request):
        allocation = self.cache.allocate(request.model_fingerprint, request.count)
        metrics.evictions.labels(tier="l2").inc(allocation.evicted)
        return kvcached_pb2.AllocateSlotsResponse(allocation_id=allocation.allocation_id, slots=allocation.slots)

    @_rpc
    def CommitBlocks(self, request):
        commit = self.cache.commit(request.model_fingerprint, request.cache_salt, request.token_ids,
                                   request.first_page, request.slots, request.allocation_id)
        return kvcached_pb2.CommitBlocksResponse(inserted=commit.inserted, already_cached=commit.already_cached)

    @_rpc
    def ReleaseLease(self, request):
        self.cache.release(request.lease_id)
        return kvcached_pb2.ReleaseLeaseResponse()

    @_rpc
    def GetStats(self, request):
        return kvcached_pb2.KVCacheStats(namespaces=[
            kvcached_pb2.NamespaceStats(
                model_fingerprint=ns.fingerprint, slots_total=ns.pool.num_slots, slots_free=ns.pool.num_free,
                blocks_cached=ns.index.total_pages, leases=self.cache.leases(ns),
                allocations=self.cache.allocations(ns))
            for ns in self.cache.namespaces()])
