"""The constrained-decoding corpus (`tests/data/grammar_corpus.py`) on the real model, in-process and batched:
every output of every JSON schema parses and validates with `jsonschema`, every regex output fullmatches with `re`,
greedy and sampled, and each request ends with "stop" (the grammar's end), never "length". Greedy, jump-forward
(on by default) gives the tokens of token-by-token decoding (on the first 16 schemas)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from model_worker.config import EngineConfig
from model_worker.engine import Engine
from model_worker.request import Constraint, ConstraintKind, RequestOutput, SamplingParams
from tests.data.grammar_corpus import MAX_NEW_TOKENS, REGEXES, SCHEMAS
from tests.engine_helpers import run_until_idle

MODES = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 1.0, "top_p": 0.95, "seed": 7}}
CASES = ([(f"schema {i}: {what}", Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)), what)
          for i, (what, schema) in enumerate(SCHEMAS)]
         + [(f"regex {i}: {what}", Constraint(ConstraintKind.REGEX, regex), what)
            for i, (what, regex) in enumerate(REGEXES)])


def corpus_engine(model_dir, **config) -> Engine:
    # float32; every case queued at once, 16 running x (prompt + 160 tokens) in pages of 16
    return Engine(model_dir, EngineConfig(dtype="float32", num_pages=512, max_waiting_requests=len(CASES),
                                          kvcached="", **config))


@pytest.fixture(scope="module")
def engine(real_model_dir) -> Engine:
    return corpus_engine(real_model_dir)


GREEDY_RUN: dict[str, list[RequestOutput]] = {}  # the greedy test's outputs, for the jump-forward comparison


def prompt(engine: Engine, constraint: Constraint, what: str) -> list[int]:
    form = "JSON" if constraint.kind is ConstraintKind.JSON_SCHEMA else "text only"
    chat = [{"role": "user", "content": f"Reply with {what}, in {form}."}]
    return engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)


def run_corpus(engine: Engine, mode: dict, cases=CASES) -> dict[str, list[RequestOutput]]:
    """Every case in one batched run: the outputs of each, by case name."""
    outputs: dict[str, list[RequestOutput]] = {name: [] for name, _, _ in cases}
    for name, constraint, what in cases:
        sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, constraint=constraint, **mode)
        engine.add_request(name, prompt(engine, constraint, what), sampling, outputs[name].append,
                           grammar=engine.grammars.compile(constraint))
    run_until_idle(engine)
    return outputs


def check(constraint: Constraint, text: str) -> None:
    if constraint.kind is ConstraintKind.JSON_SCHEMA:
        jsonschema.validate(json.loads(text), json.loads(constraint.spec))
    else:
        assert re.fullmatch(constraint.spec, text), text


@pytest.mark.parametrize("mode", MODES)
def test_every_constrained_output_is_valid_and_complete(engine, mode):
    assert len(SCHEMAS) >= 50 and len(REGEXES) >= 20
    outputs = run_corpus(engine, MODES[mode])
    if mode == "greedy":
        GREEDY_RUN.update(outputs)
    failures = []
    for name, constraint, _ in CASES:
        text = "".join(o.text for o in outputs[name])
        finish = outputs[name][-1].finish_reason
        try:
            assert finish == "stop", f"finish_reason {finish}"
            check(constraint, text)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append(f"{name}: {text!r}: {str(e)[:200]}")
    assert not failures, "\n".join(failures)
    engine.check_integrity()


def test_greedy_jump_forward_gives_the_tokens_of_token_by_token_decoding(engine, real_model_dir):
    """On the first 16 schemas (one batch: token by token, the whole corpus takes minutes here)."""
    cases = CASES[:16]
    with_jump = GREEDY_RUN or run_corpus(engine, MODES["greedy"], cases)
    without = run_corpus(corpus_engine(real_model_dir, disable_jump_forward=True), MODES["greedy"], cases)
    differ = [name for name, _, _ in cases
              if [t for o in with_jump[name] for t in o.token_ids] != [t for o in without[name] for t in o.token_ids]]
    assert not differ, differ
