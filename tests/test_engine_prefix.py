"""L1 prefix reuse inside the engine (tiny random model, page size 4): exact cached counts, equal outputs."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry

from model_worker.engine import Engine
from model_worker.metrics import EngineCollector
from model_worker.prefix_cache import CacheRequest
from model_worker.request import RequestOutput, SamplingParams
from tests.engine_helpers import GREEDY, make_engine, run_until_idle

SHARED = list(range(100, 130))  # 30 tokens: 7 full pages of 4, and 2 tokens over
PROMPT_A = SHARED + [7, 8, 9]
PROMPT_B = SHARED + [11, 12, 13, 14, 15]


@pytest.fixture
def engine(tiny_llama_dir) -> Engine:
    return make_engine(tiny_llama_dir)


def run(engine: Engine, request_id: str, prompt: list[int], cache: CacheRequest = CacheRequest(),
        sampling: SamplingParams = GREEDY) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    engine.add_request(request_id, prompt, sampling, outputs.append, cache)
    run_until_idle(engine)
    engine.check_integrity()
    return outputs


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def test_second_request_reuses_shared_full_pages_with_equal_output(engine, tiny_llama_dir):
    cold_b = tokens(run(make_engine(tiny_llama_dir), "b", PROMPT_B))
    first = run(engine, "a", PROMPT_A)
    second = run(engine, "b", PROMPT_B)
    assert first[-1].cached_tokens_l1 == 0
    assert second[-1].cached_tokens_l1 == 28  # the 7 full pages of SHARED
    assert second[-1].cached_tokens_l2 == 0
    assert tokens(second) == cold_b


def test_identical_prompt_reuses_all_but_the_last_token(engine):
    first = tokens(run(engine, "a", PROMPT_A[:32]))  # exactly 8 pages
    again = run(engine, "a2", PROMPT_A[:32])
    assert again[-1].cached_tokens_l1 == 28  # page 8 holds the last prompt token, which must be computed
    assert tokens(again) == first


def test_generated_pages_are_cached_for_the_next_turn(engine):
    first = run(engine, "turn1", PROMPT_A)
    history = PROMPT_A + tokens(first)  # 33 + 12 = 45 tokens; 44 computed (the last sample is not fed back)
    second = run(engine, "turn2", history + [42])
    assert second[-1].cached_tokens_l1 == 44


def test_the_next_turn_reuses_the_last_partial_page_with_equal_output(engine, tiny_llama_dir):
    answer = tokens(run(engine, "turn1", PROMPT_A, sampling=dataclasses.replace(GREEDY, max_new_tokens=10)))
    next_turn = PROMPT_A + answer + [42]  # 33 + 9 computed: 10 full pages, and a tail of 2 tokens
    cold = tokens(run(make_engine(tiny_llama_dir), "cold", next_turn))
    second = run(engine, "turn2", next_turn)
    assert second[-1].cached_tokens_l1 == 42
    assert tokens(second) == cold


def test_a_branch_reuses_the_tokens_it_shares_with_a_kept_tail(engine, tiny_llama_dir):
    run(engine, "a", SHARED, sampling=dataclasses.replace(GREEDY, max_new_tokens=1))  # a tail of [128, 129]
    branch = SHARED[:29] + [77, 78]
    cold = tokens(run(make_engine(tiny_llama_dir), "cold", branch))
    hit = run(engine, "branch", branch)
    assert hit[-1].cached_tokens_l1 == 29
    assert tokens(hit) == cold


def test_tails_are_evicted_before_index_pages(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_pages=16)
    answer = tokens(run(engine, "a", SHARED))  # 30 + 11 computed: 10 full pages and a tail
    assert engine.prefix.cached_pages == 11
    run(engine, "c", list(range(500, 533)))  # 11 pages: 5 free, then the tail and 5 index pages evicted
    assert engine.prefix.cached_pages == 16
    assert run(engine, "a2", SHARED + answer + [1])[-1].cached_tokens_l1 == 20


@pytest.mark.parametrize("cache", [CacheRequest(enabled=False), CacheRequest(salt="tenant-b")],
                         ids=["disabled", "other-salt"])
def test_no_reuse_when_disabled_or_salted_differently(engine, cache):
    run(engine, "a", PROMPT_A)
    assert run(engine, "b", PROMPT_B, cache)[-1].cached_tokens_l1 == 0


def test_cached_pages_are_evicted_when_the_pool_runs_short(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_pages=16)  # one request needs 11 pages
    run(engine, "a", PROMPT_A)
    assert engine.prefix.cached_pages == 11
    outputs = run(engine, "c", list(range(500, 533)))  # shares nothing: 5 pages free, 6 evicted
    assert outputs[-1].finish_reason == "length"
    assert engine.prefix.cached_pages == 16
    assert run(engine, "a2", PROMPT_A)[-1].cached_tokens_l1 == 20  # a kept its first 5 pages: LRU from the leaf end


def test_abort_keeps_the_computed_prefix_cached(engine):
    outputs: list[RequestOutput] = []
    engine.add_request("a", PROMPT_A, GREEDY, outputs.append)
    engine.step()  # prefill only
    engine.abort("a")
    engine.check_integrity()
    assert outputs[-1].finish_reason == "abort"
    assert run(engine, "b", PROMPT_B)[-1].cached_tokens_l1 == 28


def test_engine_metrics_report_the_pool(engine):
    run(engine, "a", PROMPT_A)
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    model = {"model": engine.info.name}
    assert registry.get_sample_value("radixserve_worker_l1_pages_cached", model) == 11.0
    assert registry.get_sample_value("radixserve_worker_running_requests", model) == 0.0
    assert registry.get_sample_value("radixserve_worker_l1_pages_total", model) == 64.0
