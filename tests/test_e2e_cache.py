"""Prefix reuse through real processes: kvcached, two workers with the real model, and three routers.

    router_a ──► worker_a ──┐
    router_b ──► worker_b ──┼──► kvcached (L2 in shared memory)
    router_off ─► worker_a  │    (--disable-radix-cache: the reference output)
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from radixserve.launch import LocalServices, wait_for
from radixserve.v1 import router_pb2
from tests.stack import GREEDY, PAGE, ask, cached_blocks, document, generate, router_stub, segments_of

pytestmark = pytest.mark.e2e

def shared_full_page_tokens(router: str, a, b) -> int:
    tokenize = router_stub(router).Tokenize
    ids_a = tokenize(router_pb2.TokenizeRequest(messages=a)).token_ids
    ids_b = tokenize(router_pb2.TokenizeRequest(messages=b)).token_ids
    common = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
    return common // PAGE * PAGE


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    services = LocalServices(tmp_path_factory.mktemp("logs"))
    try:
        kvcached, worker_a, worker_b = services.kvcached_and_two_workers()
        routers = {"a": services.router([worker_a], kvcached, "router_a"),
                   "b": services.router([worker_b], kvcached, "router_b"),
                   "off": services.router([worker_a], kvcached, "router_off", ["--disable-radix-cache"]),
                   "both": services.router([worker_b, worker_a], kvcached, "router_both")}
        yield services, kvcached, routers, (worker_a, worker_b)
    finally:
        services.stop()


def test_second_request_reuses_the_shared_prefix_with_equal_output(cluster):
    _, _, routers, _ = cluster
    first, second = ask(document(1), "What lies on the table?"), ask(document(1), "What was lit at dusk?")
    generate(routers["a"], first)
    hit = generate(routers["a"], second)
    reference = generate(routers["off"], second)
    shared = shared_full_page_tokens(routers["a"], first, second)
    assert shared >= 20 * PAGE
    assert hit.usage.cached_tokens >= 0.9 * shared
    assert hit.usage.cached_tokens == hit.usage.cached_tokens_l1 + hit.usage.cached_tokens_l2
    assert reference.usage.cached_tokens == 0
    assert list(hit.token_ids) == list(reference.token_ids)


def test_the_next_turn_reuses_the_previous_turn_to_the_token_with_equal_output(cluster):
    """Its answer's last, partial page included (the worker's kept tails)."""
    _, _, routers, _ = cluster
    stub = router_stub(routers["a"])
    ids = list(stub.Tokenize(router_pb2.TokenizeRequest(messages=ask(document(4), "Who rang the bell?"))).token_ids)
    answer_tokens = 8 + (-len(ids)) % PAGE  # the turn's K/V ends half-way through a page
    sampling = router_pb2.SamplingParams(temperature=0, max_new_tokens=answer_tokens, ignore_eos=True)
    (turn,) = stub.Generate(router_pb2.GenerateRequest(token_ids=ids, sampling=sampling), timeout=120)
    next_turn = router_pb2.GenerateRequest(token_ids=ids + list(turn.token_ids) + ids[-20:], sampling=GREEDY)
    (hit,) = stub.Generate(next_turn, timeout=120)
    (reference,) = router_stub(routers["off"]).Generate(next_turn, timeout=120)
    assert hit.usage.cached_tokens_l1 == len(ids) + answer_tokens - 1
    assert list(hit.token_ids) == list(reference.token_ids)


def test_prefix_computed_by_worker_a_is_reused_by_worker_b(cluster):
    _, kvcached, routers, _ = cluster
    prompt = ask(document(2), "Where does the river bend?")
    before = cached_blocks(kvcached)
    on_a = generate(routers["a"], prompt)
    prompt_pages = on_a.usage.prompt_tokens // PAGE
    assert wait_for(lambda: cached_blocks(kvcached) >= before + prompt_pages, timeout_s=10)
    on_b = generate(routers["b"], prompt)
    assert on_b.usage.cached_tokens_l2 >= 0.9 * (prompt_pages - 1) * PAGE
    assert on_b.usage.cached_tokens_l1 == 0
    assert list(on_b.token_ids) == list(on_a.token_ids)


def test_router_sends_a_prompt_to_the_worker_that_holds_its_prefix(cluster):
    _, _, routers, _ = cluster
    long_run = router_pb2.GenerateRequest(messages=ask(document(30), "Count the boats."), stream=True,
                                          sampling=router_pb2.SamplingParams(temperature=0, max_new_tokens=40))
    busy = router_stub(routers["both"]).Generate(long_run, timeout=120)
    next(busy)  # worker_b (listed first) is now busy with it
    first = generate(routers["both"], ask(document(31), "Who keeps the ledger?"))  # least loaded: worker_a
    for _ in busy:
        pass
    follow_up = generate(routers["both"], ask(document(31), "What was lit?"))  # both idle: worker_a holds it
    assert first.usage.cached_tokens == 0
    assert follow_up.usage.cached_tokens_l1 > 0 and follow_up.usage.cached_tokens_l2 == 0


def test_kill_9_kvcached_mid_stream_then_restart_brings_hits_back(cluster):
    services, kvcached, routers, workers = cluster
    daemon = services.processes["kvcached"]
    prompts = [ask(document(3 + i), "Who repaired the bell?") for i in range(6)]
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(generate, routers["a" if i % 2 else "b"], p) for i, p in enumerate(prompts)]
        time.sleep(1.0)
        services.stop_service("kvcached", signal.SIGKILL)
        answers = [f.result() for f in futures]
    assert all(a.finish_reason in ("stop", "length") and a.token_ids for a in answers)

    services.start_again("kvcached")
    restarted = services.processes["kvcached"]
    assert services.workers_registered(list(workers))
    hits = []
    for seed in range(20, 23):  # a commit racing the restart may still have gone to the dead pool
        prompt = ask(document(seed), "What did the children count?")
        pages = generate(routers["b"], prompt).usage.prompt_tokens // PAGE
        wait_for(lambda: cached_blocks(kvcached) >= pages, timeout_s=5)
        hits.append(generate(routers["a"], prompt).usage.cached_tokens_l2)
        if hits[-1]:
            break
    assert hits[-1] > 0, hits

    services.stop()
    assert segments_of({daemon.pid, restarted.pid}) == set()
