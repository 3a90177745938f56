"""Faults stay with the request that caused them (tiny random Llama, in process): a poison sampling parameter, a
forward that fails for one request in a batch, a full queue, a dead step loop."""

from __future__ import annotations

import threading

import pytest

from model_worker.engine import Engine, Overloaded
from model_worker.request import RequestOutput, SamplingParams
from tests.engine_helpers import GREEDY, make_engine, run_until_idle

PROMPTS = {"a": list(range(100, 140)), "b": list(range(300, 317)), "c": list(range(1000, 1024, 2))}


def run_together(engine: Engine, sampling: dict[str, SamplingParams]) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in sampling}
    for rid, params in sampling.items():
        engine.add_request(rid, PROMPTS[rid], params, outputs[rid].append)
    run_until_idle(engine)
    engine.check_integrity()
    return outputs


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


@pytest.fixture(scope="module")
def alone(tiny_llama_dir) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, run by itself."""
    engine = make_engine(tiny_llama_dir)
    return {rid: tokens(run_together(engine, {rid: GREEDY})[rid]) for rid in PROMPTS}


def test_a_poison_temperature_beside_two_normal_requests(tiny_llama_dir, alone):
    engine = make_engine(tiny_llama_dir)
    poison = SamplingParams(temperature=1e-40, max_new_tokens=12, ignore_eos=True)
    outputs = run_together(engine, {"a": GREEDY, "b": poison, "c": GREEDY})
    assert tokens(outputs["a"]) == alone["a"] and tokens(outputs["c"]) == alone["c"]
    assert tokens(outputs["b"]) == alone["b"]  # below the sampling epsilon: greedy
    assert [out[-1].finish_reason for out in outputs.values()] == ["length"] * 3


def test_non_finite_logits_end_their_request_alone(tiny_llama_dir, alone, monkeypatch):
    engine = make_engine(tiny_llama_dir)
    forward = engine.model.forward
    steps = []

    def poisoned(ids, positions, meta, logits_rows):
        logits = forward(ids, positions, meta, logits_rows).clone()  # an inference tensor: no in-place update
        steps.append(len(logits))
        if len(steps) == 1:  # the first step prefills a, b and c and samples their first tokens, in that order
            logits[1] = float("nan")
        return logits

    monkeypatch.setattr(engine.model, "forward", poisoned)
    outputs = run_together(engine, {"a": GREEDY, "b": GREEDY, "c": GREEDY})
    assert outputs["b"][-1].finish_reason == "error" and "not finite" in outputs["b"][-1].error
    assert tokens(outputs["a"]) == alone["a"] and tokens(outputs["c"]) == alone["c"]


def test_a_forward_that_fails_for_one_request_fails_only_it(tiny_llama_dir, alone, monkeypatch):
    engine = make_engine(tiny_llama_dir)
    forward = engine.model.forward

    def fails_with_b(ids, positions, meta, logits_rows):
        if 316 in ids.tolist():  # b's last prompt token: its prefill, alone or batched
            raise RuntimeError("a kernel failed")
        return forward(ids, positions, meta, logits_rows)

    monkeypatch.setattr(engine.model, "forward", fails_with_b)
    outputs = run_together(engine, {"a": GREEDY, "b": GREEDY, "c": GREEDY})
    assert outputs["b"] and outputs["b"][-1].finish_reason == "error"
    assert "forward pass failed: RuntimeError" in outputs["b"][-1].error
    assert tokens(outputs["a"]) == alone["a"] and tokens(outputs["c"]) == alone["c"]


def test_a_full_queue_refuses_at_once_past_either_bound(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_waiting_requests=2, max_waiting_tokens=60)
    engine.add_request("1", PROMPTS["a"], GREEDY, lambda out: None)
    with pytest.raises(Overloaded, match="40 prompt tokens are waiting; 40 more would pass --max-waiting-tokens 60"):
        engine.add_request("2", PROMPTS["a"], GREEDY, lambda out: None)
    engine.add_request("3", PROMPTS["b"], GREEDY, lambda out: None)
    with pytest.raises(Overloaded, match="2 requests are waiting"):
        engine.add_request("4", [5, 6, 7], GREEDY, lambda out: None)
    run_until_idle(engine)
    engine.check_integrity()


def test_a_dead_step_loop_calls_on_death(tiny_llama_dir, monkeypatch):
    engine = make_engine(tiny_llama_dir)
    died = threading.Event()

    def broken_loop() -> None:
        raise SystemError("the loop itself broke")

    monkeypatch.setattr(engine, "_run_loop", broken_loop)
    engine.start(on_death=died.set)
    assert died.wait(10) and engine.dead
    engine.stop()

