"""Prompt-lookup drafts: what `NgramDrafter` proposes, and that the engine verifying them gives greedy decoding's
tokens in fewer forwards (the real model: its CPU kernels compute a row the same alone or beside a draft)."""

from __future__ import annotations

import pytest

from model_worker.request import RequestOutput, SamplingParams
from model_worker.speculation import NgramDrafter
from tests.engine_helpers import make_engine, run_until_idle


def test_the_longest_tail_found_earlier_gives_what_followed_its_latest_occurrence():
    assert NgramDrafter().propose([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2) == [9, 2]  # (1, 2, 3) beats (2, 3), last before 7
    assert NgramDrafter().propose([4, 2, 3, 9, 2, 3, 7, 1, 2, 3], 3) == [7, 1, 2]  # (2, 3): the latest occurrence
    assert NgramDrafter().propose([5, 5], 4) == [5]  # only what is known
    assert NgramDrafter().propose([1, 2, 3], 2) == []  # 3 never came before
    assert NgramDrafter().propose([], 2) == [] and NgramDrafter().propose([1, 1], 0) == []


def test_the_index_grows_with_the_tokens():
    drafter, tokens = NgramDrafter(), [10, 11, 12]
    assert drafter.propose(tokens, 2) == []
    tokens += [10]
    assert drafter.propose(tokens, 2) == [11, 12]
    tokens += [13, 10]
    assert drafter.propose(tokens, 2) == [13, 10]  # 10 was last followed by 13
    assert drafter.propose(tokens, 0) == []
    assert NgramDrafter().propose(tokens, 2) == [13, 10]  # the same as indexing all at once


@pytest.fixture(scope="module")
def engines(real_model_dir):
    return {tokens: make_engine(real_model_dir, num_pages=256, page_size=16, speculative_tokens=tokens)
            for tokens in (0, 3)}


def test_drafts_give_greedy_tokens_in_fewer_forwards(engines):
    # text that repeats itself, so that drafts are often right; and one that does not
    prompts = [[504, 5575, 436, 281, 260, 3426, 30, 198] * 6, list(range(1000, 1040)), [28, 3786, 198, 1425] * 8]
    results = {}
    for tokens, engine in engines.items():
        outputs: dict[str, list[RequestOutput]] = {}
        for i, prompt in enumerate(prompts):
            outputs[str(i)] = []
            engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_new_tokens=24 + i, ignore_eos=True),
                               outputs[str(i)].append)
        steps = run_until_idle(engine)
        engine.check_integrity()
        results[tokens] = ([[t for o in outputs[str(i)] for t in o.token_ids] for i in range(len(prompts))], steps)
    (drafted, drafted_steps), (plain, plain_steps) = results[3], results[0]
    assert drafted == plain
    assert [len(tokens) for tokens in plain] == [24, 25, 26]
    assert drafted_steps < plain_steps


def test_sampled_requests_get_no_drafts(engines):
    engine = engines[3]
    rows, model = [], engine.model

    def counted(input_ids, *rest):
        rows.append(len(input_ids))
        return model(input_ids, *rest)

    engine.model = counted
    outputs: list[RequestOutput] = []
    engine.add_request("s", [504, 5575, 436, 281] * 8, SamplingParams(temperature=0.8, seed=1, max_new_tokens=12,
                                                                       ignore_eos=True), outputs.append)
    try:
        steps = run_until_idle(engine)
    finally:
        engine.model = model
    assert sum(len(o.token_ids) for o in outputs) == 12 and steps == 12  # one token a forward
    assert rows == [32] + [1] * 11  # the prompt, then each decode without a draft, accepted or not
