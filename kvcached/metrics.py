"""kvcached's Prometheus metrics. Counters, not ratios: a hit rate is `hit_tokens / query_tokens` in PromQL."""

from prometheus_client import Counter, Gauge, Histogram

blocks = Gauge("radixserve_kvcached_blocks", "Blocks per tier and state", ["tier", "state"])
bytes_ = Gauge("radixserve_kvcached_bytes", "Bytes per tier and state", ["tier", "state"])
match_queries = Counter("radixserve_kvcached_match_queries_total", "MatchPrefix calls")
query_tokens = Counter("radixserve_kvcached_query_tokens_total", "Full-page tokens asked about by MatchPrefix")
hit_tokens = Counter("radixserve_kvcached_hit_tokens_total", "Tokens MatchPrefix found cached", ["tier"])
evictions = Counter("radixserve_kvcached_evictions_total", "Blocks evicted", ["tier"])
leases = Gauge("radixserve_kvcached_leases", "Live leases")
expired = Counter("radixserve_kvcached_expired_total", "Leases and allocations dropped at their TTL")
rpc_latency = Histogram("radixserve_kvcached_rpc_seconds", "RPC handling time", ["method"],
                        buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1))
