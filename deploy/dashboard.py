"""The Grafana dashboard of a radixserve deployment, as code: `python -m deploy.dashboard` writes
`deploy/grafana/dashboards/radixserve.json`, which Grafana is provisioned with (docker-compose.yml).

Built with the Grafana Foundation SDK (`grafana-foundation-sdk`, its Grafana 11.6 line). The generated JSON is
committed; `tests/test_deploy.py` checks that it equals what this module produces now, and that every metric each
panel queries is one the services export (`router/metrics.py`, `kvcached/metrics.py`, `model_worker/metrics.py`).

Every query reads the Prometheus data source provisioned under uid `prometheus`; the jobs are `router`,
`kvcached` and `worker` (`deploy/prometheus.yml`), and per-worker series keep their `instance` label.
"""

from __future__ import annotations

import json
from pathlib import Path

from grafana_foundation_sdk.builders.dashboard import Dashboard, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.timeseries import Panel
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

OUTPUT = Path(__file__).resolve().parent / "grafana" / "dashboards" / "radixserve.json"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="prometheus")
RATE = "[$__rate_interval]"


def rate(metric: str, by: str = "") -> str:
    """`sum [by (labels)] (rate(metric[$__rate_interval]))`: a per-second rate over every scraped instance."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{RATE}))"


def quantile(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{RATE})))"


def per_tier_share(part: str, whole: str) -> str:
    """The rate of counter `part` per `tier` label over the rate of `whole` (which has no tier label)."""
    return f"{rate(part, 'tier')} / ignoring(tier) group_left {rate(whole)}"


def panel(title: str, unit: str, description: str, *queries: tuple[str, str]) -> Panel:
    """A time series panel, half the dashboard's width, of `(expr, legend)` queries."""
    built = Panel().title(title).unit(unit).description(description).datasource(DATASOURCE).height(8).span(12)
    for ref, (expr, legend) in zip("ABCDEFGH", queries, strict=False):
        built = built.with_target(Dataquery().datasource(DATASOURCE).ref_id(ref).expr(expr).legend_format(legend))
    return built


def latency() -> list[Panel]:
    ttft = "radixserve_time_to_first_token_seconds"
    e2e = "radixserve_e2e_request_latency_seconds"
    # NOTE: no metric times the gaps between tokens; the mean inter-token latency is derived from the router's
    # histograms and counters: (e2e time - TTFT) over the tokens generated after each request's first.
    decode_time = f"({rate(e2e + '_sum')} - {rate(ttft + '_sum')})"
    later_tokens = f"({rate('radixserve_generation_tokens_total')} - {rate(e2e + '_count')} > 0)"
    return [
        panel("Time to first token", "s", "Router: from the start of Generate to the first token.",
              *((quantile(q, ttft), f"p{round(q * 100)}") for q in (0.5, 0.95, 0.99))),
        panel("Inter-token latency (mean, derived)", "s",
              "No metric times each token: (e2e latency - TTFT) summed over requests, divided by the tokens "
              "generated after each request's first one (generation tokens - requests).",
              (f"{decode_time} / {later_tokens}", "mean")),
        panel("End-to-end latency", "s", "Router: from the start of Generate to the last token.",
              *((quantile(q, e2e), f"p{round(q * 100)}") for q in (0.5, 0.95, 0.99))),
        panel("Prefetch wait", "s", "Router: time requests waited for kvcached to load their disk-tier pages "
              "into L2 (--prefetch-policy).",
              *((quantile(q, "radixserve_prefetch_wait_time_seconds"), f"p{round(q * 100)}") for q in (0.5, 0.95))),
    ]


def throughput() -> list[Panel]:
    return [
        panel("Token throughput", "short", "Router: prompt tokens admitted and tokens generated, per second.",
              (rate("radixserve_generation_tokens_total"), "generated/s"),
              (rate("radixserve_prompt_tokens_total"), "prompt/s")),
        panel("Requests", "reqps", "Router: finished requests per second by outcome.",
              (rate("radixserve_requests_total", "outcome"), "{{outcome}}")),
    ]


def cache() -> list[Panel]:
    return [
        panel("Prompt tokens served from cache, per tier", "percentunit",
              "Router: reused prompt tokens by the tier they came from (l1: the worker's pool; l2: kvcached's "
              "shared memory; l3: loaded from disk for the request) over all prompt tokens.",
              (per_tier_share("radixserve_cached_tokens_total", "radixserve_prompt_tokens_total"), "{{tier}}")),
        panel("kvcached match hit ratio, per tier", "percentunit",
              "kvcached: tokens MatchPrefix found per tier over the full-page tokens it was asked about.",
              (per_tier_share("radixserve_kvcached_hit_tokens_total", "radixserve_kvcached_query_tokens_total"),
               "{{tier}}")),
        panel("Prefetches", "short", "Per second. Router: requests whose disk-tier pages were all in L2 at dispatch "
              "(hit) or not yet (miss). kvcached: L3 -> L2 prefetches started, blocks loaded.",
              (rate("radixserve_prefetch_hit_total"), "hit"), (rate("radixserve_prefetch_miss_total"), "miss"),
              (rate("radixserve_kvcached_prefetches_total"), "started"),
              (rate("radixserve_kvcached_prefetched_blocks_total"), "blocks loaded")),
    ]


def queues() -> list[Panel]:
    return [
        panel("Router queues", "short", "Requests admitted and not finished; requests waiting for a prefetch.",
              ("sum (radixserve_waiting_queue_size)", "admitted, unfinished"),
              ("sum (radixserve_prefetch_queue_size)", "waiting for prefetch")),
        panel("Worker queues", "short", "Per worker: requests queued and in the running batch.",
              ("radixserve_worker_waiting_requests", "waiting {{instance}}"),
              ("radixserve_worker_running_requests", "running {{instance}}")),
    ]


def tiers() -> list[Panel]:
    usage = 'sum by (tier) (radixserve_kvcached_bytes{state="%s"})'
    return [
        panel("L2 / L3 usage", "percentunit", "kvcached: bytes cached over capacity, shared memory (l2) and disk "
              "(l3).", (f"{usage % 'cached'} / {usage % 'total'}", "{{tier}}")),
        panel("L2 / L3 bytes", "bytes", "kvcached: bytes cached and capacity per tier.",
              (usage % "cached", "{{tier}} cached"), (usage % "total", "{{tier}} capacity")),
        panel("L1 pages", "short", "Per worker: KV pages held (by requests or the prefix cache), cached, total.",
              ("radixserve_worker_l1_pages_used", "used {{instance}}"),
              ("radixserve_worker_l1_pages_cached", "cached {{instance}}"),
              ("radixserve_worker_l1_pages_total", "total {{instance}}")),
        panel("Disk tier bandwidth", "Bps", "kvcached: bytes read from (prefetch) and written to L3 per second.",
              (rate("radixserve_kvcached_l3_read_bytes_total"), "read"),
              (rate("radixserve_kvcached_l3_written_bytes_total"), "written")),
    ]


def integrity() -> list[Panel]:
    return [
        panel("Corrupt and rejected pages", "short",
              "Per second: L3 blocks failing their checksum; leased L2 pages a worker refused (by reason) and "
              "recomputed; blocks kept out of L3 (slot header mismatch); L3 writes dropped; prefetches ended early.",
              (rate("radixserve_kvcached_corrupt_blocks_total"), "L3 corrupt"),
              (rate("radixserve_worker_l2_pages_rejected_total", "reason"), "L2 rejected: {{reason}}"),
              (rate("radixserve_kvcached_l3_unverified_blocks_total"), "L3 unverified"),
              (rate("radixserve_kvcached_l3_dropped_writes_total"), "L3 dropped writes"),
              (rate("radixserve_kvcached_prefetch_failures_total", "reason"), "prefetch ended: {{reason}}")),
        panel("Errors", "short", "Per second: failed kvcached calls (router, worker) by op, worker jobs dropped "
              "for a slow kvcached, kvcached background failures; and the disk tier's health (1 = working).",
              (rate("radixserve_kvcached_errors_total", "op"), "router→kvcached {{op}}"),
              (rate("radixserve_worker_kvcached_errors_total", "op"), "worker→kvcached {{op}}"),
              (rate("radixserve_worker_kvcached_dropped_jobs_total", "op"), "worker dropped {{op}}"),
              (rate("radixserve_kvcached_background_errors_total", "task"), "background {{task}}"),
              (rate("radixserve_kvcached_integrity_failures_total"), "integrity check failed"),
              ("min (radixserve_kvcached_l3_healthy)", "L3 healthy")),
    ]


def ratio(numerator: str, denominator: str) -> str:
    """Per model, the rate of counter `numerator` over the rate of counter `denominator`."""
    return f"{rate(numerator, 'model')} / {rate(denominator, 'model')}"


def rates() -> list[Panel]:
    """The four rates of `Router/Stats` (docs/design.md, section 11), over the dashboard's window."""
    loaded = 'radixserve_l1_load_pages_total{outcome="loaded"}'
    wait = "radixserve_prefetch_wait_time_seconds"
    return [
        panel("Radix hit rate", "percentunit", "Router: prompt tokens reused from any tier over prompt tokens.",
              (ratio("radixserve_cached_tokens_total", "radixserve_prompt_tokens_total"), "{{model}}")),
        panel("L1 load success rate", "percentunit", "Router: L2 pages the worker copied into L1 over the L2 pages "
              "leased to it beyond its L1 hit (the rest failed its checks and were recomputed).",
              (ratio(loaded, "radixserve_l1_load_pages_total"), "{{model}}")),
        panel("Mean prefetch wait", "s", "Router: seconds requests waited for their L3 -> L2 prefetch, per request "
              "that waited.", (ratio(wait + "_sum", wait + "_count"), "{{model}}")),
        panel("Scheduler block rate", "percentunit", "Workers: admitted requests the scheduler passed over at least "
              "once first (no free pages, batch full, or the step's prefill budget spent) over admitted requests.",
              (ratio("radixserve_worker_blocked_requests_total", "radixserve_worker_admitted_requests_total"),
               "{{model}}")),
    ]


ROWS = (("Rates", rates), ("Latency", latency), ("Throughput", throughput), ("Prefix cache", cache),
        ("Queues", queues), ("Tiers", tiers), ("Integrity and errors", integrity))


def build() -> dict:
    """The dashboard as Grafana's JSON model (a dict)."""
    dashboard = (Dashboard("radixserve").uid("radixserve").tags(["radixserve"]).refresh("10s")
                 .time("now-30m", "now").timezone("browser"))
    for title, panels in ROWS:
        dashboard = dashboard.with_row(Row(title))
        for built in panels():
            dashboard = dashboard.with_panel(built)
    return json.loads(JSONEncoder().encode(dashboard.build()))


def render() -> str:
    """The file's text: `build()` as indented JSON with sorted keys, so that a change shows as a small diff."""
    return json.dumps(build(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main() -> None:
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(render())
    print(OUTPUT)


if __name__ == "__main__":
    main()
