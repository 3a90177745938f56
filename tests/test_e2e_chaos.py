"""Keeps serving on its worst day, through real processes: a worker killed mid-run, kvcached frozen under load,
overload past every queue, a poison temperature beside normal requests. Every answer that completes is compared,
token for token, with the same prompt's answer with every cache off.

    router ─────► worker_a, worker_b ──► kvcached
    router_off ─► worker_a (--disable-radix-cache: the references)
    router_tight ► worker_a (admission bounds of a few requests: overload)
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from radixserve.launch import LocalServices, wait_for
from radixserve.server import retry_after_s
from radixserve.v1 import router_pb2, worker_pb2
from tests.stack import GREEDY, ask, document, generate, router_stub, worker_stub

pytestmark = pytest.mark.e2e

FLOAT32 = ["--dtype", "float32"]  # batched decode equals decode alone in float32 (test_engine_real.py)
SENTENCES = 12  # ~128-token prompts
LONG = router_pb2.SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)


def prompt(seed: int):
    return ask(document(seed, SENTENCES), "What is this about?")


def greedy_tokens(router: str, messages) -> list[int]:
    return list(generate(router, messages).token_ids)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    services = LocalServices(tmp_path_factory.mktemp("chaos-logs"))
    try:
        kvcached = services.kvcached()
        workers = [services.worker(kvcached, name, FLOAT32) for name in ("worker_a", "worker_b")]
        routers = {"both": services.router(workers, kvcached, "router"),
                   "off": services.router(workers[:1], kvcached, "router_off", ["--disable-radix-cache"]),
                   "tight": services.router(workers[:1], kvcached, "router_tight",
                                            ["--max-pending-requests", "2"])}
        yield services, kvcached, workers, routers
    finally:
        services.stop()


def test_a_poison_temperature_beside_two_normal_requests(cluster):
    _, _, _, routers = cluster
    prompts = [prompt(300 + i) for i in range(3)]
    references = [greedy_tokens(routers["off"], p) for p in prompts]
    poison = router_pb2.SamplingParams(temperature=1e-40, max_new_tokens=GREEDY.max_new_tokens)
    requests = [router_pb2.GenerateRequest(messages=p, sampling=s) for p, s in zip(prompts, (GREEDY, poison, GREEDY))]
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda r: router_stub(routers["both"]).Generate(r, timeout=120), requests))
    finals = [list(stream)[-1] for stream in answers]
    assert [list(f.token_ids) for f in finals] == references  # the poison one is greedy: below 1e-5
    assert all(f.finish_reason in ("stop", "length") for f in finals)
    # Past the router's validation, straight to a worker: its sampler treats it as greedy too.
    ids = router_stub(routers["off"]).Tokenize(router_pb2.TokenizeRequest(messages=prompts[1]), timeout=30).token_ids
    direct = worker_pb2.WorkerGenerateRequest(request_id="poison", prompt_ids=ids, sampling=worker_pb2.ResolvedSampling(
        temperature=1e-40, top_p=1, max_new_tokens=GREEDY.max_new_tokens))
    (*_, last) = worker_stub(cluster[2][0]).Generate(direct, timeout=120)
    assert last.finish_reason in ("stop", "length")


def test_overload_gets_resource_exhausted_with_a_retry_delay_and_every_admitted_answer_is_right(cluster):
    _, _, _, routers = cluster
    prompts = [prompt(310 + i % 3) for i in range(12)]
    references = {i: greedy_tokens(routers["off"], prompts[i]) for i in range(3)}

    def ask_tight(i: int):
        try:
            return i, generate(routers["tight"], prompts[i])
        except grpc.RpcError as e:
            return i, e

    with ThreadPoolExecutor(12) as pool:
        outcomes = list(pool.map(ask_tight, range(12)))
    refused = [e for _, e in outcomes if isinstance(e, grpc.RpcError)]
    served = [(i, r) for i, r in outcomes if not isinstance(r, grpc.RpcError)]
    assert refused and served, "twelve at once past a bound of two: some are refused, some served"
    for e in refused:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "overloaded" in e.details()
        assert retry_after_s(e) == 1.0
    for i, response in served:
        assert list(response.token_ids) == references[i % 3]


def test_a_frozen_kvcached_costs_reuse_never_a_request(cluster):
    services, _, _, routers = cluster
    prompts = [prompt(320 + i) for i in range(3)]
    references = [greedy_tokens(routers["off"], p) for p in prompts]
    daemon = services.processes["kvcached"]
    daemon.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        answers = [generate(routers["both"], p) for p in prompts]
        frozen_s = time.monotonic() - started
    finally:
        daemon.send_signal(signal.SIGCONT)
    assert [list(a.token_ids) for a in answers] == references
    assert all(a.usage.cached_tokens_l2 == 0 for a in answers)
    assert frozen_s < 60, f"three short requests took {frozen_s:.0f} s with kvcached frozen"
    again = generate(routers["both"], prompts[0])  # kvcached is back: reuse resumes
    assert list(again.token_ids) == references[0]


def test_kill_9_one_of_two_workers_mid_run(cluster):
    """Runs last: it leaves one worker restarted."""
    services, _, workers, routers = cluster
    prompts = [prompt(330 + i) for i in range(4)]
    references = [greedy_tokens(routers["off"], p) for p in prompts]
    streams = [router_stub(routers["both"]).Generate(
        router_pb2.GenerateRequest(messages=p, sampling=LONG, stream=True), timeout=120) for p in prompts]
    firsts = [next(s) for s in streams]  # all four are running, on both workers
    assert all(f.token_ids for f in firsts)
    services.stop_service("worker_b", signal.SIGKILL)
    outcomes = []
    for stream in streams:
        try:
            outcomes.append(list(stream)[-1].finish_reason)
        except grpc.RpcError as e:
            outcomes.append(e.code())
    assert grpc.StatusCode.UNAVAILABLE in outcomes and "length" in outcomes  # only the victim's requests failed
    assert set(outcomes) <= {grpc.StatusCode.UNAVAILABLE, "length"}
    after = [greedy_tokens(routers["both"], p) for p in prompts]  # all on worker_a now
    assert after == references

    services.start_again("worker_b")  # a fresh worker_b: its L1 is empty until the router uses it again
    seeds = iter(range(340, 400, 2))
    assert wait_for(lambda: _two_at_once(routers["both"], next(seeds)) or _served_anything(workers[1]), 60)


def _two_at_once(router: str, seed: int) -> None:
    """Two new prompts at once: the router's least-loaded choice sends one to each worker it sees healthy (new ones,
    so that no worker's prefix memory draws them)."""
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda i: generate(router, prompt(seed + i)), range(2)))


def _served_anything(worker: str) -> bool:
    return worker_stub(worker).GetInfo(worker_pb2.GetInfoRequest(), timeout=5).kv_pages_cached > 0
