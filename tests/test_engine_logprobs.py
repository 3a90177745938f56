"""Logprobs, prompt scoring and constrained decoding (with jump-forward) in the engine: tiny random-weight Llama for
exactness against the model's own prefill logits, and the real model in float32 for scoring against generation."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from model_worker.config import EngineConfig
from model_worker.engine import Engine
from model_worker.prefix_cache import CacheRequest
from model_worker.request import Constraint, ConstraintKind, RequestOutput, SamplingParams
from tests.engine_helpers import make_engine, prefill_logits, run_until_idle

PROMPT = list(range(100, 140))
OTHER = list(range(300, 317))
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> Engine:
    return make_engine(tiny_llama_dir)


def run(engine: Engine, prompt: list[int], sampling: SamplingParams, cache: CacheRequest | None = None,
        request_id: str = "r") -> list[RequestOutput]:
    """One request to completion (with whatever else is queued); its outputs."""
    outputs: list[RequestOutput] = []
    grammar = engine.grammars.compile(sampling.constraint) if sampling.constraint else None
    engine.add_request(request_id, prompt, sampling, outputs.append, cache or CacheRequest(), grammar)
    run_until_idle(engine)
    return outputs


def generated(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def reference(engine: Engine, ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every position of `ids`, in one prefill."""
    return torch.log_softmax(prefill_logits(engine, ids, chunk=len(ids)), dim=-1)


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=5),
    SamplingParams(temperature=0.3, top_k=5, seed=3, max_new_tokens=8, ignore_eos=True, logprobs=True,
                   top_logprobs=5),
], ids=["greedy", "sampled"])
def test_generated_logprobs_are_the_raw_distribution(engine, sampling):
    """Before temperature and top-k: what a prefill of the same tokens gives, with the top 5 in order."""
    outputs = run(engine, PROMPT, sampling)
    tokens = generated(outputs)
    expected = reference(engine, PROMPT + tokens[:-1])[len(PROMPT) - 1:]
    assert [len(o.logprobs) for o in outputs] == [1] * len(tokens)
    for row, token, got in zip(expected, tokens, (o.logprobs[0] for o in outputs)):
        assert got.token_id == token
        assert got.logprob == pytest.approx(row[token].item(), abs=TOLERANCE)
        values, ids = row.topk(5)
        assert [t for t, _ in got.top] == ids.tolist()
        assert [v for _, v in got.top] == pytest.approx(values.tolist(), abs=TOLERANCE)
        if sampling.temperature == 0:
            assert got.top[0][0] == token


def test_no_logprobs_unless_asked(engine):
    outputs = run(engine, PROMPT, SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    assert all(o.logprobs == () and o.prompt_logprobs == () for o in outputs)


SCORE = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True, prompt_logprobs=True, top_logprobs=2)


def check_prompt_scores(engine: Engine, outputs: list[RequestOutput], prompt: list[int]) -> None:
    expected = reference(engine, prompt)
    scores = outputs[0].prompt_logprobs
    assert [s.token_id for s in scores] == prompt[1:]
    for position, score in enumerate(scores):
        assert score.logprob == pytest.approx(expected[position, prompt[position + 1]].item(), abs=TOLERANCE)
        assert [t for t, _ in score.top] == expected[position].topk(2).indices.tolist()
    assert all(o.prompt_logprobs == () for o in outputs[1:])


def test_prompt_logprobs_score_every_prompt_token_after_the_first(engine):
    check_prompt_scores(engine, run(engine, PROMPT, SCORE), PROMPT)


def test_prompt_logprobs_are_the_same_chunked_batched_and_after_a_cache_hit(engine, tiny_llama_dir):
    chunked = make_engine(tiny_llama_dir, chunked_prefill_size=7, max_prefill_tokens=7)
    check_prompt_scores(chunked, run(chunked, PROMPT, SCORE), PROMPT)
    run(engine, PROMPT, SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True))  # caches its pages
    others: list[RequestOutput] = []
    engine.add_request("other", OTHER, SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True),
                       others.append)
    outputs = run(engine, PROMPT, SCORE)
    assert outputs[0].cached_tokens_l1 == 0  # scoring reuses no page: a cached page has no logits
    check_prompt_scores(engine, outputs, PROMPT)
    assert others[-1].finish_reason == "length"
    engine.check_integrity()


def test_scoring_from_a_start_reuses_the_prefix_before_it_and_scores_the_same(engine):
    full = run(engine, PROMPT, SCORE)[0].prompt_logprobs  # also caches the prompt's pages
    start = len(PROMPT) - 3
    outputs = run(engine, PROMPT, dataclasses.replace(SCORE, prompt_logprobs_start=start))
    page = engine.pool.page_size
    assert outputs[0].cached_tokens_l1 == (start - 1) // page * page > 0
    scores = outputs[0].prompt_logprobs
    assert [s.token_id for s in scores] == PROMPT[start:]
    assert [s.logprob for s in scores] == pytest.approx([s.logprob for s in full[start - 1:]], abs=TOLERANCE)
    assert [[t for t, _ in s.top] for s in scores] == [[t for t, _ in s.top] for s in full[start - 1:]]
    engine.check_integrity()


ACCOUNT = {"type": "object", "properties": {"customer_name": {"type": "string", "maxLength": 6},
                                            "account_number": {"type": "integer", "minimum": 0, "maximum": 999},
                                            "preferred_contact_channel": {"enum": ["email", "telephone"]}},
           "required": ["customer_name", "account_number", "preferred_contact_channel"]}


def test_jump_forward_takes_what_the_grammar_forces_in_fewer_forwards_with_the_same_output(tiny_llama_dir):
    sampling = SamplingParams(temperature=0.0, max_new_tokens=80, logprobs=True, top_logprobs=2,
                              constraint=Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(ACCOUNT)))
    results = {}
    for jump in (True, False):
        engine = make_engine(tiny_llama_dir, disable_jump_forward=not jump)
        forwards = 0
        model = engine.model

        def counted(*args, model=model):
            nonlocal forwards
            forwards += 1
            return model(*args)

        engine.model = counted
        outputs = run(engine, PROMPT, sampling)
        engine.check_integrity()
        results[jump] = (generated(outputs), [lp for o in outputs for lp in o.logprobs], forwards)
    (tokens, logprobs, forwards), (plain_tokens, plain_logprobs, plain_forwards) = results[True], results[False]
    assert tokens == plain_tokens and len(tokens) == plain_forwards  # one forward per token without jump-forward
    assert [lp.logprob for lp in logprobs] == pytest.approx([lp.logprob for lp in plain_logprobs], abs=TOLERANCE)
    assert forwards <= plain_forwards - 15  # the three keys and their quotes are forced: ~25 tokens
    text = make_engine(tiny_llama_dir).tokenizer.decode(tokens[:-1])
    assert set(json.loads(text)) == set(ACCOUNT["properties"])


YES_NO = SamplingParams(temperature=0.0, max_new_tokens=16, constraint=Constraint(ConstraintKind.REGEX, "(yes|no)"))


def test_a_constraint_ends_the_output_even_where_the_model_would_not(engine):
    """The random tiny model never picks EOS by itself: the grammar leaves it nothing else once complete."""
    outputs = run(engine, PROMPT, YES_NO)
    assert outputs[-1].finish_reason == "stop" and generated(outputs)[-1] == 2
    assert "".join(o.text for o in outputs) in ("yes", "no")


def test_constrained_and_free_requests_share_a_batch_without_leaking_the_mask(engine):
    free = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    alone = generated(run(engine, OTHER, free))
    free_outputs: list[RequestOutput] = []
    engine.add_request("free", OTHER, free, free_outputs.append)
    digits = SamplingParams(temperature=1.0, seed=5, max_new_tokens=10,
                            constraint=Constraint(ConstraintKind.REGEX, r"\d{3}"))
    constrained = run(engine, PROMPT, digits, request_id="digits")
    assert generated(free_outputs) == alone
    assert re.fullmatch(r"\d{3}", "".join(o.text for o in constrained))


def test_constrained_greedy_output_is_the_same_with_and_without_a_cache_hit(engine):
    sampling = SamplingParams(temperature=0.0, max_new_tokens=24, constraint=Constraint(
        ConstraintKind.JSON_SCHEMA, json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                                                "required": ["n"]})))
    uncached = run(engine, PROMPT, sampling, CacheRequest(enabled=False))
    cold = run(engine, PROMPT, sampling)
    hit = run(engine, PROMPT, sampling)
    assert hit[0].cached_tokens_l1 > 0 and uncached[0].cached_tokens_l1 == 0
    assert generated(hit) == generated(cold) == generated(uncached)
    json.loads("".join(o.text for o in hit))


def test_a_constraint_and_its_grammar_come_together(engine):
    compiled = engine.grammars.compile(YES_NO.constraint)
    with pytest.raises(ValueError, match="compiled grammar"):
        engine.add_request("a", PROMPT, YES_NO, lambda o: None)
    with pytest.raises(ValueError, match="compiled grammar"):
        engine.add_request("b", PROMPT, SamplingParams(), lambda o: None, grammar=compiled)
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, constraint=YES_NO.constraint)
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(logprobs=True, top_logprobs=21)
    assert not engine.scheduler.has_work()


def test_scoring_a_generation_equals_its_logprobs_real_model_float32(real_model_dir):
    """Greedy generation (free, and constrained by a JSON schema) with logprobs, then the same tokens scored as a
    prompt: each token's score equals its reported logprob, so the sums agree."""
    engine = Engine(real_model_dir, EngineConfig(dtype="float32", num_pages=128, kvcached=""))
    chat = [{"role": "user", "content": "Describe a cat as JSON with its name and age."}]
    prompt = engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 30}},
              "required": ["name", "age"]}
    for constraint in (None, Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))):
        outputs = run(engine, prompt, SamplingParams(temperature=0.0, max_new_tokens=20, logprobs=True,
                                                     constraint=constraint))
        tokens = generated(outputs)
        reported = [o.logprobs[0].logprob for o in outputs]
        scored = run(engine, prompt + tokens, SamplingParams(temperature=0.0, max_new_tokens=1, prompt_logprobs=True))
        scores = scored[0].prompt_logprobs[len(prompt) - 1:]
        assert [s.token_id for s in scores] == tokens
        assert [s.logprob for s in scores] == pytest.approx(reported, abs=TOLERANCE)
        assert sum(s.logprob for s in scores) == pytest.approx(sum(reported), abs=TOLERANCE)
    engine.check_integrity()
