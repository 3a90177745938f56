"""kvcached's Prometheus metrics. Counters, not ratios: a hit rate is `hit_tokens / query_tokens` in PromQL.

Events are counted where they happen; sizes and states are read from the cache at scrape time (`CacheCollector`),
so no RPC pays for keeping gauges current.
"""

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvcached.cache import KVCache

match_queries = Counter("radixserve_kvcached_match_queries_total", "MatchPrefix calls")
query_tokens = Counter("radixserve_kvcached_query_tokens_total", "Full-page tokens asked about by MatchPrefix")
hit_tokens = Counter("radixserve_kvcached_hit_tokens_total", "Tokens MatchPrefix found cached", ["tier"])
evictions = Counter("radixserve_kvcached_evictions_total", "Blocks evicted", ["tier"])
integrity_failures = Counter("radixserve_kvcached_integrity_failures_total", "Idle integrity checks that failed")
expired = Counter("radixserve_kvcached_expired_total", "Leases and allocations dropped at their TTL")
rpc_latency = Histogram("radixserve_kvcached_rpc_seconds", "RPC handling time", ["method"],
                        # MatchPrefix ~1-2 ms at 100k blocks; WaitPrefetch up to the policy's wait or a deadline
                        buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                                 10, 60))
prefetches = Counter("radixserve_kvcached_prefetches_total", "L3 -> L2 prefetches started")
prefetched_blocks = Counter("radixserve_kvcached_prefetched_blocks_total", "Blocks loaded from L3 into L2")
prefetch_failures = Counter("radixserve_kvcached_prefetch_failures_total", "Prefetches ended early", ["reason"])
background_errors = Counter("radixserve_kvcached_background_errors_total", "Background task rounds that failed",
                            ["task"])


class CacheCollector:
    """Blocks, bytes and leases per tier, and the disk tier's own running totals (counted on its threads).

    NOTE: scrapes run on the metrics HTTP thread while the event loop changes the cache; everything read here is a
    plain attribute or a snapshot taken in one C-level call, so a scrape never sees a dict change size under it.
    """

    def __init__(self, cache: KVCache):
        self._cache = cache

    def collect(self):
        namespaces = self._cache.namespaces()
        blocks = GaugeMetricFamily("radixserve_kvcached_blocks", "Blocks per tier and state", labels=["tier", "state"])
        size = GaugeMetricFamily("radixserve_kvcached_bytes", "Bytes per tier and state", labels=["tier", "state"])
        for state, count in (("total", lambda ns: ns.pool.num_slots), ("cached", lambda ns: ns.index.total_pages)):
            blocks.add_metric(["l2", state], sum(count(ns) for ns in namespaces))
            size.add_metric(["l2", state], sum(count(ns) * ns.geometry.block_bytes for ns in namespaces))
        yield GaugeMetricFamily("radixserve_kvcached_leases", "Live leases", value=self._cache.leases())
        if self._cache.l3 is not None:
            stats = self._cache.l3.disk.stats()
            blocks.add_metric(["l3", "cached"], stats.blocks)
            size.add_metric(["l3", "cached"], stats.bytes_used)
            size.add_metric(["l3", "total"], stats.bytes_total)
            yield GaugeMetricFamily("radixserve_kvcached_l3_healthy", "1 while the disk tier works, 0 after an I/O "
                                    "error", value=stats.healthy)
            yield from _disk_counters(stats)
            yield CounterMetricFamily("radixserve_kvcached_l3_unverified_blocks", "Blocks kept out of L3 because "
                                      "their slot's header did not name them", value=self._cache.l3.unverified_blocks)
        yield blocks
        yield size


def _disk_counters(stats):
    for name, doc, value in (
            ("radixserve_kvcached_corrupt_blocks", "L3 blocks that failed their checksum", stats.corrupt_blocks),
            ("radixserve_kvcached_l3_read_bytes", "Bytes read from L3 (rate() = bandwidth)", stats.bytes_read),
            ("radixserve_kvcached_l3_written_bytes", "Bytes written to L3 (rate() = bandwidth)", stats.bytes_written),
            ("radixserve_kvcached_l3_evictions", "Blocks evicted from L3", stats.evictions),
            ("radixserve_kvcached_l3_dropped_writes", "L3 writes dropped (queue full, map full)",
             stats.dropped_writes)):
        yield CounterMetricFamily(name, doc, value=value)


def watch(cache: KVCache) -> None:
    REGISTRY.register(CacheCollector(cache))
