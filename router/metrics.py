"""The router's Prometheus metrics, named as the public contract in docs/design.md says."""

from prometheus_client import Counter, Gauge, Histogram

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

time_to_first_token = Histogram("radixserve_time_to_first_token_seconds", "Time from request to first token",
                                buckets=TTFT_BUCKETS)
e2e_latency = Histogram("radixserve_e2e_request_latency_seconds", "Time from request to last token",
                        buckets=TTFT_BUCKETS + (60, 120))
prompt_tokens = Counter("radixserve_prompt_tokens_total", "Prompt tokens of admitted requests")
generation_tokens = Counter("radixserve_generation_tokens_total", "Generated tokens")
cached_tokens = Counter("radixserve_cached_tokens_total", "Prompt tokens served from a cache tier", ["tier"])
waiting_queue_size = Gauge("radixserve_waiting_queue_size", "Requests admitted and not yet finished")
requests = Counter("radixserve_requests_total", "Finished requests by outcome", ["outcome"])
kvcached_errors = Counter("radixserve_kvcached_errors_total", "kvcached calls that failed or timed out", ["op"])
prefetch_hit = Counter("radixserve_prefetch_hit", "Requests whose disk-tier pages were all in L2 at dispatch")
prefetch_miss = Counter("radixserve_prefetch_miss", "Requests dispatched before all their disk-tier pages loaded")
prefetch_wait_time = Histogram("radixserve_prefetch_wait_time_seconds", "Time requests waited for a prefetch",
                               buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2.5, 5, 10))
prefetch_queue_size = Gauge("radixserve_prefetch_queue_size", "Requests waiting for their prefetch")
