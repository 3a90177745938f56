"""Tracing and metrics through real processes: an OTLP trace receiver in this process gets one trace per Generate
from all three services, and the router's Stats RPC reports the four rates this module causes.

    router_warm ──► worker_a ──┐   worker_a computes the document; kvcached restarts (L2 lost, L3 kept); then the
    router ───────► worker_b ──┴─► kvcached   traced request on worker_b waits for its prefetch (wait_complete),
       (traced)   (traced, one request at a time)   copies the loaded pages L2 → L1, prefills, decodes, commits
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import urllib.request
from concurrent import futures
from pathlib import Path

import pytest

from bench.tracing import Receiver
from radixserve.launch import LocalServices, free_port, wait_for
from radixserve.v1 import router_pb2
from tests.stack import GRPCURL, PAGE, ask, document, generate, kvcached_stats, router_stub

pytestmark = pytest.mark.e2e

READ_DELAY_MS = 10  # per L3 block after the restart, so the traced request really waits for its prefetch
LONG = router_pb2.SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)  # > 1 page: a commit at the end
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def attributes(span) -> dict[str, object]:
    values = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        values[a.key] = getattr(a.value, kind)
    return values


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    receiver = Receiver()
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # export within 0.1 s (the SDK's default waits 5 s)
    traced = ["--otlp-traces-endpoint", receiver.endpoint]
    metrics_ports = {name: free_port() for name in ("router", "worker_b", "kvcached")}
    services = LocalServices(tmp_path_factory.mktemp("logs"))
    try:
        kvcached = services.kvcached(args=[*traced, "--metrics-port", str(metrics_ports["kvcached"])])
        worker_a = services.worker(kvcached, "worker_a")
        worker_b = services.worker(kvcached, "worker_b", [*traced, "--max-running-requests", "1",
                                                          "--metrics-port", str(metrics_ports["worker_b"])])
        warm = services.router([worker_a], kvcached, "router_warm")
        router = services.router([worker_b], kvcached, "router", [
            *traced, "--prefetch-policy", "wait_complete", "--metrics-port", str(metrics_ports["router"])])
        prompt = ask(document(70), "Which lamp was lit?")
        warmed = generate(warm, prompt)
        pages = warmed.usage.prompt_tokens // PAGE
        assert wait_for(lambda: kvcached_stats(kvcached).disk.blocks >= pages)
        # The slowed reads would make kvcached judge L3 not worth loading; say recompute is slower still.
        assert services.stop_service("kvcached") == 0
        services.start_again("kvcached", ["--l3-read-delay-ms", str(READ_DELAY_MS), "--recompute-tokens-per-s", "20"])
        assert services.workers_registered([worker_a, worker_b])
        client_context = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
        (traced_answer,) = router_stub(router).Generate(
            router_pb2.GenerateRequest(messages=prompt, sampling=LONG), timeout=120,
            metadata=[("traceparent", client_context)])
        yield {"receiver": receiver, "router": router, "worker_b": worker_b, "prompt": prompt,
               "traced": traced_answer, "metrics_ports": metrics_ports}
    finally:
        services.stop()
        receiver.stop()
        os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)


EXPECTED = {  # span: (service, parent span)
    "router.generate": ("radixserve-router", None),
    "router.tokenize": ("radixserve-router", "router.generate"),
    "router.prefix_match": ("radixserve-router", "router.generate"),
    "router.prefetch_wait": ("radixserve-router", "router.generate"),
    "router.worker_generate": ("radixserve-router", "router.generate"),
    "kvcached.WaitPrefetch": ("radixserve-kvcached", "router.prefetch_wait"),
    "worker.generate": ("radixserve-worker", "router.worker_generate"),
    "worker.queue": ("radixserve-worker", "worker.generate"),
    "worker.l2_to_l1_copy": ("radixserve-worker", "worker.generate"),
    "worker.prefill": ("radixserve-worker", "worker.generate"),
    "worker.decode": ("radixserve-worker", "worker.generate"),
    "worker.commit": ("radixserve-worker", "worker.generate"),
    "kvcached.AllocateSlots": ("radixserve-kvcached", "worker.commit"),
    "kvcached.CommitBlocks": ("radixserve-kvcached", "worker.commit"),
}


def test_one_generate_is_one_trace_across_the_three_services(cluster):
    receiver, answer = cluster["receiver"], cluster["traced"]
    assert answer.usage.cached_tokens_l3 > 0 and answer.timings.prefetch_wait_ms > 0  # the scenario happened

    def complete() -> bool:
        names = {span.name for _, span in receiver.trace(CLIENT_TRACE)}
        return set(EXPECTED) <= names and "kvcached.MatchPrefix" in names

    assert wait_for(complete, 15), sorted({s.name for _, s in receiver.trace(CLIENT_TRACE)})
    spans = receiver.trace(CLIENT_TRACE)
    by_id = {span.span_id: span for _, span in spans}
    named = {span.name: (service, span) for service, span in spans}
    for name, (service, parent) in EXPECTED.items():
        got_service, span = named[name]
        assert got_service == service, name
        if parent is None:
            assert span.parent_span_id.hex() == CLIENT_SPAN  # the client's trace context is honoured
        else:
            assert by_id[span.parent_span_id].name == parent, name
        assert span.start_time_unix_nano <= span.end_time_unix_nano, name
    matches = [span for _, span in spans if span.name == "kvcached.MatchPrefix"]
    assert sorted(by_id[m.parent_span_id].name for m in matches) == ["router.prefetch_wait", "router.prefix_match"]

    root = attributes(named["router.generate"][1])
    assert root["radixserve.prompt_tokens"] == answer.usage.prompt_tokens
    assert root["radixserve.cached_tokens.l3"] == answer.usage.cached_tokens_l3
    assert root["radixserve.cached_tokens.l1"] == 0
    assert root["radixserve.finish_reason"] == "length"
    wait = attributes(named["router.prefetch_wait"][1])
    assert wait["radixserve.prefetch.policy"] == "wait_complete"
    assert wait["radixserve.prefetch.pages_loaded"] * PAGE >= answer.usage.cached_tokens_l3
    assert attributes(named["router.worker_generate"][1])["radixserve.worker"] == cluster["worker_b"]
    copy = attributes(named["worker.l2_to_l1_copy"][1])
    assert copy["radixserve.cached_tokens.l2"] == answer.usage.cached_tokens_l2 + answer.usage.cached_tokens_l3
    decode = attributes(named["worker.decode"][1])
    assert decode["radixserve.completion_tokens"] == 20 and decode["radixserve.finish_reason"] == "length"
    # the phases follow each other inside the worker's span
    worker = named["worker.generate"][1]
    phases = [named[n][1] for n in ("worker.queue", "worker.l2_to_l1_copy", "worker.prefill", "worker.decode")]
    assert worker.start_time_unix_nano <= phases[0].start_time_unix_nano
    for before, after in itertools.pairwise(phases):
        assert before.end_time_unix_nano <= after.start_time_unix_nano + 1
    assert phases[-1].end_time_unix_nano <= worker.end_time_unix_nano


def grpcurl_stats(router: str) -> dict:
    out = subprocess.run([GRPCURL, "-plaintext", router, "radixserve.v1.Router/Stats"], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return json.loads(out)


def test_stats_rates_match_what_the_requests_did(cluster):
    router, answers = cluster["router"], [cluster["traced"]]
    answers.append(generate(router, cluster["prompt"]))  # again: an L1 hit on worker_b, nothing to load or wait
    assert answers[-1].usage.cached_tokens_l1 > 0
    # Two new prompts at once on a worker that runs one request at a time: exactly one waits for the other.
    stub = router_stub(router)
    with futures.ThreadPoolExecutor(2) as pool:
        pair = [pool.submit(lambda seed: list(stub.Generate(router_pb2.GenerateRequest(
            messages=ask(document(seed), "Who counted boats?"), sampling=LONG), timeout=120))[-1], seed)
            for seed in (71, 72)]
        answers += [f.result() for f in pair]

    (model,) = router_stub(router).Stats(router_pb2.StatsRequest(), timeout=10).models
    cached = sum(a.usage.cached_tokens for a in answers)
    prompt = sum(a.usage.prompt_tokens for a in answers)
    assert (model.radix_hit_rate.numerator, model.radix_hit_rate.denominator) == (cached, prompt)
    assert model.radix_hit_rate.value == pytest.approx(cached / prompt)
    copied = sum(a.usage.cached_tokens_l2 + a.usage.cached_tokens_l3 for a in answers) // PAGE
    assert copied > 0
    assert (model.l1_load_success_rate.numerator, model.l1_load_success_rate.denominator) == (copied, copied)
    waited = cluster["traced"].timings.prefetch_wait_ms / 1e3
    assert model.mean_prefetch_wait_s.denominator == 1
    assert model.mean_prefetch_wait_s.numerator == pytest.approx(waited, rel=1e-6)
    assert (model.scheduler_block_rate.numerator, model.scheduler_block_rate.denominator) == (1, 4)
    assert model.scheduler_block_rate.value == 0.25 and model.workers_answered == 1

    over_grpcurl = grpcurl_stats(router)["models"][0]  # readable with grpcurl, through reflection
    assert over_grpcurl["scheduler_block_rate"]["value"] == 0.25


def exposition(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def documented_metrics() -> set[str]:
    """Every full metric name in docs/design.md's metrics section."""
    design = (Path(__file__).parents[1] / "docs" / "design.md").read_text()
    section = design.split("### Metrics", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"\bradixserve_[a-z0-9_]*[a-z0-9]\b(?!_?\*)", section))


def test_documented_metrics_are_served_with_the_model_label(cluster):
    texts = {name: exposition(port) for name, port in cluster["metrics_ports"].items()}
    served = set()
    for text in texts.values():
        for family in re.findall(r"^# TYPE (\w+) (\w+)", text, re.MULTILINE):
            served.add(family[0])
            served.add(family[0] + "_total" if family[1] == "counter" else family[0])
    missing = documented_metrics() - served
    assert not missing, sorted(missing)
    model = router_stub(cluster["router"]).ListModels(router_pb2.ListModelsRequest(), timeout=10).models[0].name
    for name in ("radixserve_time_to_first_token_seconds_count", "radixserve_prompt_tokens_total",
                 "radixserve_l1_load_pages_total"):
        assert re.search(rf'^{name}{{[^}}]*model="{re.escape(model)}"', texts["router"], re.MULTILINE), name
    assert re.search(rf'^radixserve_worker_admitted_requests_total{{model="{re.escape(model)}"}} ', texts["worker_b"],
                     re.MULTILINE)
