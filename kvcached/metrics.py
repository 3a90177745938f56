"""kvcached's Prometheus metrics. Counters, not ratios: a hit rate is `hit_tokens / query_tokens` in PromQL."""

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from kvcached.tiers.lmdb_tier import DiskTier

blocks = Gauge("radixserve_kvcached_blocks", "Blocks per tier and state", ["tier", "state"])
bytes_ = Gauge("radixserve_kvcached_bytes", "Bytes per tier and state", ["tier", "state"])
match_queries = Counter("radixserve_kvcached_match_queries_total", "MatchPrefix calls")
query_tokens = Counter("radixserve_kvcached_query_tokens_total", "Full-page tokens asked about by MatchPrefix")
hit_tokens = Counter("radixserve_kvcached_hit_tokens_total", "Tokens MatchPrefix found cached", ["tier"])
evictions = Counter("radixserve_kvcached_evictions_total", "Blocks evicted", ["tier"])
leases = Gauge("radixserve_kvcached_leases", "Live leases")
integrity_failures = Counter("radixserve_kvcached_integrity_failures_total", "Idle integrity checks that failed")
expired = Counter("radixserve_kvcached_expired_total", "Leases and allocations dropped at their TTL")
rpc_latency = Histogram("radixserve_kvcached_rpc_seconds", "RPC handling time", ["method"],
                        buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1))
prefetches = Counter("radixserve_kvcached_prefetches_total", "L3 -> L2 prefetches started")
prefetched_blocks = Counter("radixserve_kvcached_prefetched_blocks_total", "Blocks loaded from L3 into L2")
prefetch_failures = Counter("radixserve_kvcached_prefetch_failures_total", "Prefetches ended early", ["reason"])
l3_healthy = Gauge("radixserve_kvcached_l3_healthy", "1 while the disk tier works, 0 after an I/O error")


class DiskCollector:
    """The disk tier's own running totals, read at scrape time (the tier counts them on its threads)."""

    def __init__(self, disk: DiskTier):
        self._disk = disk

    def collect(self):
        stats = self._disk.stats()
        for name, doc, value in (
                ("radixserve_kvcached_corrupt_blocks", "L3 blocks that failed their checksum", stats.corrupt_blocks),
                ("radixserve_kvcached_l3_read_bytes", "Bytes read from L3 (rate() = bandwidth)", stats.bytes_read),
                ("radixserve_kvcached_l3_written_bytes", "Bytes written to L3 (rate() = bandwidth)",
                 stats.bytes_written),
                ("radixserve_kvcached_l3_evictions", "Blocks evicted from L3", stats.evictions),
                ("radixserve_kvcached_l3_dropped_writes", "L3 writes dropped (queue full, map full)",
                 stats.dropped_writes)):
            yield CounterMetricFamily(name, doc, value=value)


def watch_disk(disk: DiskTier) -> None:
    REGISTRY.register(DiskCollector(disk))
