"""The pure parts of tracing and the Stats rates: where spans go, that "off" loads nothing, and how the rates are
counted (the end-to-end test is tests/test_e2e_observability.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from radixserve import tracing
from radixserve.v1 import worker_pb2
from router import metrics, stats


@pytest.mark.parametrize(("flag", "environ", "endpoint"), [
    ("", {}, ""),
    ("http://collector:4317", {}, "http://collector:4317"),
    ("127.0.0.1:4317", {}, "http://127.0.0.1:4317"),  # bare HOST:PORT: plaintext
    ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317"}, "http://a:4317"),
    ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://b:4317"},
     "https://b:4317"),
    ("http://flag:4317", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317"}, "http://flag:4317"),
    ("http://flag:4317", {"OTEL_SDK_DISABLED": "true"}, ""),
    ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317", "OTEL_TRACES_EXPORTER": "none"}, ""),
])
def test_traces_endpoint(flag, environ, endpoint):
    assert tracing.traces_endpoint(flag, environ) == endpoint


def test_off_installs_nothing_and_loads_no_sdk():
    script = ("import sys; from radixserve import tracing; import router.service, model_worker.service, "
              "kvcached.service\n"
              "assert not tracing.setup('router', '', {})\n"
              "assert not tracing.enabled() and tracing.outgoing() is None and tracing.extract(()) is None\n"
              "with tracing.span('x') as span: assert not span.is_recording()\n"
              "assert [m for m in sys.modules if m.startswith('opentelemetry.sdk')] == []\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


@pytest.mark.parametrize(("leased", "usable", "l1", "copied", "expected"), [
    (0, 10, 0, 0, (0, 0)),  # no lease: nothing offered
    (6, 10, 0, 96, (6, 0)),  # all six copied
    (6, 10, 32, 64, (4, 0)),  # two were in L1 already: four offered, four copied
    (6, 10, 0, 48, (3, 3)),  # three failed their checks
    (10, 9, 0, 144, (9, 0)),  # the last full page of a prompt is never reused: nine offered
    (4, 10, 80, 0, (0, 0)),  # L1 held more than the lease: nothing offered
])
def test_l1_load_counts_offered_pages_beyond_the_l1_hit(leased, usable, l1, copied, expected):
    assert stats.l1_load(leased, usable, l1, copied, page_size=16) == expected


def test_model_stats_reads_the_served_counters():
    series = metrics.of("stats-test-model")
    series.prompt_tokens.inc(400)
    series.cached_tokens("l1").inc(64)
    series.cached_tokens("l3").inc(96)
    series.l1_load_pages("loaded").inc(6)
    series.l1_load_pages("rejected").inc(2)
    series.prefetch_wait_time.observe(0.25)
    series.prefetch_wait_time.observe(0.15)
    workers = [worker_pb2.WorkerInfo(admitted_requests=3, blocked_requests=1),
               worker_pb2.WorkerInfo(admitted_requests=5, blocked_requests=0)]
    got = stats.model_stats("stats-test-model", workers)
    assert (got.radix_hit_rate.numerator, got.radix_hit_rate.denominator, got.radix_hit_rate.value) == (
        160, 400, 0.4)
    assert (got.l1_load_success_rate.numerator, got.l1_load_success_rate.denominator) == (6, 8)
    assert got.mean_prefetch_wait_s.value == pytest.approx(0.2)
    assert (got.scheduler_block_rate.numerator, got.scheduler_block_rate.denominator) == (1, 8)
    assert got.workers_answered == 2
    empty = stats.model_stats("no-such-model", [])
    assert empty.radix_hit_rate.value == 0 and empty.scheduler_block_rate.denominator == 0
