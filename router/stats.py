"""The four rates of the Stats RPC (definitions in docs/design.md, "Observability"), computed from the very counters
the router's Prometheus endpoint serves, and from the workers' admission counts (their `GetInfo`). Pure: it reads a
registry and worker infos, and changes nothing."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import REGISTRY, CollectorRegistry

from radixserve.v1 import router_pb2, worker_pb2

TIERS = ("l1", "l2", "l3")


def rate(numerator: float, denominator: float) -> router_pb2.Rate:
    return router_pb2.Rate(value=numerator / denominator if denominator else 0.0, numerator=numerator,
                           denominator=denominator)


def l1_load(leased_pages: int, usable_pages: int, l1_tokens: int, copied_tokens: int, page_size: int
            ) -> tuple[int, int]:
    """(loaded, rejected) L2 pages of one request: of the leased pages the worker could use beyond its own L1 hit,
    those it copied into L1 and those it did not (they failed its checks and were recomputed)."""
    offered = max(0, min(leased_pages, usable_pages) - l1_tokens // page_size)
    loaded = min(offered, copied_tokens // page_size)
    return loaded, offered - loaded


def model_stats(model: str, workers: Sequence[worker_pb2.WorkerInfo],
                registry: CollectorRegistry = REGISTRY) -> router_pb2.ModelStats:
    """The rates of `model` since the router started; `workers` are the infos of the workers that answered."""
    def count(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, {"model": model, **labels}) or 0.0

    cached = sum(count("radixserve_cached_tokens_total", tier=tier) for tier in TIERS)
    loaded = count("radixserve_l1_load_pages_total", outcome="loaded")
    return router_pb2.ModelStats(
        model=model,
        radix_hit_rate=rate(cached, count("radixserve_prompt_tokens_total")),
        l1_load_success_rate=rate(loaded, loaded + count("radixserve_l1_load_pages_total", outcome="rejected")),
        mean_prefetch_wait_s=rate(count("radixserve_prefetch_wait_time_seconds_sum"),
                                  count("radixserve_prefetch_wait_time_seconds_count")),
        scheduler_block_rate=rate(sum(w.blocked_requests for w in workers),
                                  sum(w.admitted_requests for w in workers)),
        workers_answered=len(workers))
