"""The router's Prometheus metrics, named as the public contract in docs/design.md says, each labelled with the model.

Buckets fit the latencies measured here (docs/design.md, section 9): a TTFT runs from ~0.25 s (an L1 hit) through
~0.7-0.9 s (L2, L3) to ~6-7 s (a cold 2,000-token prompt on 2 CPU cores), and a GPU is 10-100x faster; a request's
end-to-end time adds its decode, 17 tokens/s alone on CPU (128 tokens ≈ 8 s, the 4,096-token limit ≈ 4 min);
a prefetch wait is bounded by the timeout policy's 200 ms, or by the client's deadline under wait_complete.
"""

from __future__ import annotations

import functools

from prometheus_client import Counter, Gauge, Histogram

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2.5, 5, 7.5, 10, 15, 30, 60)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 7.5, 10, 15, 30, 60, 120, 300, 600)
PREFETCH_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

_M = ["model"]
time_to_first_token = Histogram("radixserve_time_to_first_token_seconds", "Time from request to first token", _M,
                                buckets=TTFT_BUCKETS)
e2e_latency = Histogram("radixserve_e2e_request_latency_seconds", "Time from request to last token", _M,
                        buckets=E2E_BUCKETS)
prompt_tokens = Counter("radixserve_prompt_tokens_total", "Prompt tokens of admitted requests", _M)
generation_tokens = Counter("radixserve_generation_tokens_total", "Generated tokens", _M)
cached_tokens = Counter("radixserve_cached_tokens_total", "Prompt tokens served from a cache tier", _M + ["tier"])
waiting_queue_size = Gauge("radixserve_waiting_queue_size", "Requests admitted and not yet finished", _M)
requests = Counter("radixserve_requests_total", "Finished requests by outcome", _M + ["outcome"])
kvcached_errors = Counter("radixserve_kvcached_errors_total", "kvcached calls that failed or timed out", _M + ["op"])
prefetch_hit = Counter("radixserve_prefetch_hit", "Requests whose disk-tier pages were all in L2 at dispatch", _M)
prefetch_miss = Counter("radixserve_prefetch_miss", "Requests dispatched before all their disk-tier pages loaded", _M)
prefetch_wait_time = Histogram("radixserve_prefetch_wait_time_seconds", "Time requests waited for a prefetch", _M,
                               buckets=PREFETCH_WAIT_BUCKETS)
prefetch_queue_size = Gauge("radixserve_prefetch_queue_size", "Requests waiting for their prefetch", _M)
l1_load_pages = Counter("radixserve_l1_load_pages_total", "L2 pages leased to a worker beyond its L1 hit: copied "
                        "into L1 (loaded) or not (rejected by its checks, recomputed)", _M + ["outcome"])


class ModelMetrics:
    """The series of one model: the metrics above with the `model` label bound (see `of`)."""

    def __init__(self, model: str):
        self.model = model
        self.time_to_first_token = time_to_first_token.labels(model)
        self.e2e_latency = e2e_latency.labels(model)
        self.prompt_tokens = prompt_tokens.labels(model)
        self.generation_tokens = generation_tokens.labels(model)
        self.waiting_queue_size = waiting_queue_size.labels(model)
        self.prefetch_hit = prefetch_hit.labels(model)
        self.prefetch_miss = prefetch_miss.labels(model)
        self.prefetch_wait_time = prefetch_wait_time.labels(model)
        self.prefetch_queue_size = prefetch_queue_size.labels(model)

    def cached_tokens(self, tier: str) -> Counter:
        return cached_tokens.labels(self.model, tier)

    def requests(self, outcome: str) -> Counter:
        return requests.labels(self.model, outcome)

    def kvcached_errors(self, op: str) -> Counter:
        return kvcached_errors.labels(self.model, op)

    def l1_load_pages(self, outcome: str) -> Counter:
        return l1_load_pages.labels(self.model, outcome)


@functools.cache
def of(model: str) -> ModelMetrics:
    """The one `ModelMetrics` of `model` (a router serves one model; the cache only saves re-binding labels)."""
    return ModelMetrics(model)
