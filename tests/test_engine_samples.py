"""`n` samples of one prompt: one prefill whose pages the samples share, each sample as if it ran alone with seed
+ i; and stop token ids. A tiny random-weight Llama in float32, pages of 4 tokens."""

import dataclasses

import pytest

from model_worker.engine import Engine
from model_worker.request import RequestOutput, SamplingParams
from tests.engine_helpers import GREEDY, make_engine, run_until_idle

PROMPT = list(range(100, 118))  # 18 tokens: 4 full pages and a partial one, which each sample must get a copy of
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_new_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> Engine:
    return make_engine(tiny_llama_dir)


class CountingModel:
    """The engine's model, counting the tokens of every forward."""

    def __init__(self, model):
        self.model, self.tokens = model, []

    def __call__(self, ids, *rest):
        self.tokens.append(len(ids))
        return self.model(ids, *rest)


def by_sample(outputs: list[RequestOutput], n: int) -> list[list[int]]:
    tokens: list[list[int]] = [[] for _ in range(n)]
    for out in outputs:
        tokens[out.index].extend(out.token_ids)
    return tokens


def run(engine: Engine, sampling: SamplingParams, prompt=PROMPT, request_id="samples") -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    engine.add_request(request_id, prompt, sampling, outputs.append)
    run_until_idle(engine)
    engine.check_integrity()
    return outputs


def test_each_sample_equals_its_own_seeded_request_and_the_prompt_is_prefilled_once(engine):
    counting = CountingModel(engine.model)
    engine.model = counting
    try:
        outputs = run(engine, dataclasses.replace(SEEDED, n=4))
    finally:
        engine.model = counting.model
    # one prefill of the prompt, then decode steps of one token per sample
    assert counting.tokens[0] == len(PROMPT) and set(counting.tokens[1:]) == {4}
    samples = by_sample(outputs, 4)
    assert [sum(o.finish_reason == "length" for o in outputs if o.index == i) for i in range(4)] == [1] * 4
    alone = []
    for i in range(4):
        engine.prefix.make_room(engine.pool.num_pages)  # no L1 hit: each runs exactly as a fresh request
        alone.append(by_sample(run(engine, dataclasses.replace(SEEDED, seed=SEEDED.seed + i)), 1)[0])
    assert samples == alone
    assert len({tuple(s) for s in samples}) > 1  # the seeds differ, so do the samples
    assert samples == by_sample(run(engine, dataclasses.replace(SEEDED, n=4)), 4)  # reproducible


def test_greedy_samples_are_equal_and_each_reports_the_prompts_reuse(engine):
    greedy = dataclasses.replace(GREEDY, n=3)
    run(engine, greedy)  # caches the prompt's full pages
    outputs = run(engine, greedy)
    samples = by_sample(outputs, 3)
    assert samples[0] == samples[1] == samples[2] == engine.generate([PROMPT], GREEDY)[0]
    finals = [o for o in outputs if o.finish_reason]
    assert sorted(o.index for o in finals) == [0, 1, 2]
    assert {o.cached_tokens_l1 for o in finals} == {16}


def test_abort_before_the_fork_ends_every_sample(engine):
    outputs: list[RequestOutput] = []
    engine.add_request("early", list(range(300, 340)), dataclasses.replace(GREEDY, n=3), outputs.append)
    engine.abort("early")
    assert sorted((o.index, o.finish_reason) for o in outputs) == [(0, "abort"), (1, "abort"), (2, "abort")]
    engine.check_integrity()


def test_abort_after_the_fork_ends_the_unfinished_samples(engine):
    outputs: list[RequestOutput] = []
    engine.add_request("late", PROMPT, dataclasses.replace(GREEDY, n=2), outputs.append)
    engine.step()
    engine.step()
    engine.abort("late")
    assert sorted(o.index for o in outputs if o.finish_reason == "abort") == [0, 1]
    assert engine.pool.num_free + engine.prefix.cached_pages == engine.pool.num_pages
    engine.check_integrity()


def test_samples_count_against_running_slots_and_pages(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, max_running_requests=4)
    with pytest.raises(ValueError, match="exceeds the 4 sequences"):
        engine.add_request("many", PROMPT, dataclasses.replace(GREEDY, n=5), lambda _: None)
    # 35 pages for one sample of 40 + 100 - 1 tokens; 3 more of 25 pages each (they share 10) pass the 64
    with pytest.raises(ValueError, match="x 4 samples needs 110 KV pages"):
        engine.add_request("big", list(range(200, 240)), dataclasses.replace(GREEDY, n=4, max_new_tokens=100),
                           lambda _: None)
    grouped = run_later(engine, "group", dataclasses.replace(GREEDY, n=3))
    single = [run_later(engine, f"single{i}", GREEDY) for i in range(2)]
    engine.step()  # the group (3 slots, forked at the end of this prefill) and one single fill the 4 slots
    assert len(engine.scheduler.running) == 4 and len(engine.scheduler.waiting) == 1
    run_until_idle(engine)
    assert by_sample(grouped, 3)[0] == by_sample(single[1], 1)[0]
    engine.check_integrity()


def run_later(engine: Engine, request_id: str, sampling: SamplingParams) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    engine.add_request(request_id, PROMPT, sampling, outputs.append)
    return outputs


def test_a_stop_token_ends_the_output_like_eos(engine, tokenizer):
    generated = engine.generate([PROMPT], GREEDY)[0]
    stop = generated[4]
    outputs = run(engine, dataclasses.replace(GREEDY, stop_token_ids=(stop,)))
    tokens = by_sample(outputs, 1)[0]
    assert tokens == generated[:generated.index(stop) + 1] and outputs[-1].finish_reason == "stop"
    text = "".join(o.text for o in outputs)
    assert text == tokenizer.decode(tokens[:-1])
