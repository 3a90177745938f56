"""The worker's Prometheus metrics: counters of its kvcached link, and its load and L1 pool read from the engine at
scrape time."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:  # the engine imports the kvcache client, which counts here
    from model_worker.engine import Engine

kvcached_errors = Counter("radixserve_worker_kvcached_errors_total", "kvcached calls that failed", ["op"])
kvcached_dropped_jobs = Counter("radixserve_worker_kvcached_dropped_jobs_total",
                                "kvcached jobs dropped because the queue to a slow kvcached was full", ["op"])
committed_blocks = Counter("radixserve_worker_committed_blocks_total", "Blocks committed to kvcached")
l2_pages_rejected = Counter("radixserve_worker_l2_pages_rejected_total", "Leased L2 pages not used, recomputed instead",
                            ["reason"])  # expired, segment, out_of_range, generation, key


class EngineCollector:
    """The engine's load and L1 pool (gauges) and its scheduler's admissions (counters, so PromQL rates them: the
    scheduler block rate is blocked / admitted), labelled with the model, read at scrape time."""

    def __init__(self, engine: Engine):
        self._engine = engine

    def collect(self):
        load = self._engine.load()
        model = [self._engine.info.name]
        for name, doc, value in (
                ("radixserve_worker_running_requests", "Requests in the running batch", load.running),
                ("radixserve_worker_waiting_requests", "Requests queued in the worker", load.waiting),
                ("radixserve_worker_l1_pages_used", "L1 KV pages held by requests or the prefix cache", load.pages_used),
                ("radixserve_worker_l1_pages_cached", "L1 KV pages in the prefix cache", load.pages_cached),
                ("radixserve_worker_l1_pages_total", "L1 KV pages", load.pages_total)):
            gauge = GaugeMetricFamily(name, doc, labels=["model"])
            gauge.add_metric(model, value)
            yield gauge
        for name, doc, value in (
                ("radixserve_worker_admitted_requests", "Requests the scheduler admitted", load.admitted),
                ("radixserve_worker_blocked_requests",
                 "Admitted requests the scheduler passed over first (no room: pages, batch, token budget)",
                 load.blocked)):
            counter = CounterMetricFamily(name, doc, labels=["model"])
            counter.add_metric(model, value)
            yield counter


def watch_engine(engine: Engine) -> None:
    REGISTRY.register(EngineCollector(engine))
