"""Our model and engine on tiny random-weight Llama and Qwen2 models, against transformers in float32."""

import os
import time

import pytest
import torch

from model_worker.config import DType, EngineConfig
from model_worker.engine import Engine, resolve_dtype
from model_worker.request import RequestOutput, SamplingParams
from model_worker.scheduler import FINISHING_STEPS
from radixserve.launch import wait_for
from tests.engine_helpers import GREEDY, make_engine, prefill_logits, run_until_idle

PROMPTS = [list(range(100, 140)), [5, 6, 7], list(range(300, 317)), list(range(1000, 1024, 2))]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> Engine:
    return make_engine(tiny_llama_dir)


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("chunk", [512, 7])
def test_logits_match_transformers(request, model_fixture, chunk):
    model_dir = request.getfixturevalue(model_fixture)
    ours = make_engine(model_dir)
    ids = PROMPTS[0]
    with torch.inference_mode():
        expected = hf_model(model_dir)(torch.tensor([ids])).logits[0]
    got = prefill_logits(ours, ids, chunk)
    # unchunked: HF's attention (is_causal SDPA), and linears that differ from HF's only in summation order; chunks
    # attend to a gathered prefix under a mask
    tolerance = 1e-5 if chunk >= len(ids) else 1e-4
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    ours.pool.check_integrity()


def test_qwen2_has_qkv_bias(tiny_qwen2_dir):
    attention = make_engine(tiny_qwen2_dir).model.model.layers[0].self_attn
    assert attention.qkv_proj.bias is not None and attention.o_proj.bias is None


def test_greedy_matches_transformers_generate(engine, tiny_llama_dir):
    hf = hf_model(tiny_llama_dir)
    for prompt in PROMPTS[:2]:
        expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12)
        assert engine.generate([prompt], GREEDY) == [expected[0, len(prompt):].tolist()]


def test_chunked_prefill_gives_same_tokens(engine, tiny_llama_dir):
    chunked = make_engine(tiny_llama_dir, chunked_prefill_size=8, max_prefill_tokens=8)
    assert chunked.generate(PROMPTS, GREEDY) == engine.generate(PROMPTS, GREEDY)


def test_batched_equals_alone_and_seeded_sampling_is_batch_independent(engine):
    alone = [engine.generate([p], GREEDY)[0] for p in PROMPTS]
    assert engine.generate(PROMPTS, GREEDY) == alone
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=11, max_new_tokens=12, ignore_eos=True)
    assert engine.generate(PROMPTS[:1], seeded) == engine.generate(PROMPTS[:3], seeded)[:1]
    assert engine.generate([], GREEDY) == []  # nothing to wait for (it used to raise "engine idle")
    engine.check_integrity()


def collect(engine: Engine, request_id: str, prompt, sampling) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    engine.add_request(request_id, prompt, sampling, outputs.append)
    return outputs


def test_outputs_timings_and_length(engine):
    outputs = collect(engine, "r", PROMPTS[1], GREEDY)
    run_until_idle(engine)
    assert [len(o.token_ids) for o in outputs] == [1] * 12
    assert [o.finish_reason for o in outputs] == [None] * 11 + ["length"]
    timed = [o for o in outputs if o.queue_ms is not None]
    assert timed == [outputs[0], outputs[-1]]
    assert all(o.prefill_ms >= 0 and o.cached_tokens_l1 is not None for o in timed)


def test_stop_string_cuts_text(engine):
    sampling = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    full = "".join(o.text for o in collect_run(engine, PROMPTS[0], sampling))
    assert len(full) > 12
    stop = full[8:12]
    outputs = collect_run(engine, PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True,
                                                             stop=(stop,)))
    assert "".join(o.text for o in outputs) == full[:full.find(stop)]
    assert outputs[-1].finish_reason == "stop"


def collect_run(engine: Engine, prompt, sampling) -> list[RequestOutput]:
    outputs = collect(engine, "stop-test", prompt, sampling)
    run_until_idle(engine)
    return outputs


def test_abort_frees_pages_and_sends_final_output(engine):
    outputs = collect(engine, "a", PROMPTS[0], GREEDY)
    engine.step()
    engine.step()
    assert engine.pool.num_free < engine.pool.num_pages
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("a", [1], GREEDY, lambda _: None)
    engine.abort("a")
    engine.abort("a")  # unknown now: no-op
    engine.check_integrity()
    assert outputs[-1].finish_reason == "abort" and outputs[-1].queue_ms is not None
    assert [o.finish_reason for o in outputs].count("abort") == 1
    assert not engine.step()


def test_long_prompt_is_chunked_while_others_decode(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, chunked_prefill_size=8)
    short = collect(engine, "short", PROMPTS[1], GREEDY)
    engine.step()  # prefill of the short prompt, first token
    long = collect(engine, "long", list(range(200, 240)), GREEDY)
    for step in range(5):  # 40 prompt tokens / 8 per step
        engine.step()
        assert len(short) == 2 + step
        assert (len(long) == 1) == (step == 4)
    run_until_idle(engine)


def test_a_step_with_nothing_to_decode_prefills_up_to_max_prefill_tokens(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, chunked_prefill_size=8, max_prefill_tokens=30)
    first = collect(engine, "first", list(range(100, 120)), GREEDY)
    second = collect(engine, "second", list(range(200, 220)), GREEDY)
    engine.step()  # nothing decodes: 30 prompt tokens, all of the first and 10 of the second
    assert len(first) == 1 and not second
    assert [s.num_computed for s in engine.scheduler.running] == [20, 10]
    engine.step()  # the first decodes: at most 8 prompt tokens beside it
    assert len(first) == 2 and not second
    assert [s.num_computed for s in engine.scheduler.running] == [21, 18]
    run_until_idle(engine)


def test_newcomers_wait_for_sequences_decoding_their_last_tokens_then_start_together(tiny_llama_dir):
    """A closed loop's round fell one step apart: `ahead` finished, and its successor arrives while `behind` decodes
    its last token. The successor waits that step (not counted as blocked: room did not hold it back), then both
    successors prefill in one step and decode in lock step. A newcomer beside a sequence with more than
    FINISHING_STEPS tokens to go is admitted at once."""
    engine = make_engine(tiny_llama_dir)
    ahead = collect(engine, "ahead", PROMPTS[0], GREEDY)
    engine.step()
    behind = collect(engine, "behind", PROMPTS[1], GREEDY)
    while not finished(ahead):
        engine.step()
    assert GREEDY.max_new_tokens - len(behind) == 1 <= FINISHING_STEPS
    order: list[str] = []
    add_in_order(engine, order, "after-ahead", PROMPTS[2])
    engine.step()
    assert finished(behind) and not order
    assert engine.scheduler.waiting and not engine.scheduler.waiting[0].blocked
    add_in_order(engine, order, "after-behind", PROMPTS[3])
    run_until_idle(engine)
    assert order == ["after-ahead", "after-behind"] * GREEDY.max_new_tokens
    assert engine.scheduler.admitted_blocked == 0

    running = collect(engine, "running", PROMPTS[0], GREEDY)
    engine.step()
    newcomer = collect(engine, "newcomer", PROMPTS[1], GREEDY)
    engine.step()
    assert len(newcomer) == 1 and len(running) == 2
    run_until_idle(engine)


def add_in_order(engine: Engine, order: list[str], request_id: str, prompt: list[int]) -> list[RequestOutput]:
    """Adds a greedy request; its outputs, and its id in `order` at each output the engine thread delivers."""
    outputs: list[RequestOutput] = []
    engine.add_request(request_id, prompt, GREEDY, lambda out: (outputs.append(out), order.append(request_id)))
    return outputs


def finished(*outputs: list[RequestOutput]) -> bool:
    return all(out and out[-1].finish_reason for out in outputs)


def test_the_arrival_window_admits_a_burst_of_unknown_size_in_one_step(tiny_llama_dir):
    """Only a lone request ran lately (a warm-up), so nothing tells how many will come: two requests arrive together
    and a third 100 ms later; the first waits the whole window and all three start in the same step."""
    engine = make_engine(tiny_llama_dir, arrival_window_ms=300)
    order: list[str] = []
    engine.start()
    try:
        warm_up = add_in_order(engine, order, "warm-up", PROMPTS[3])
        assert wait_for(lambda: finished(warm_up), 30)
        order.clear()
        burst = [add_in_order(engine, order, f"burst-{i}", PROMPTS[i]) for i in range(2)]
        time.sleep(0.1)
        burst.append(add_in_order(engine, order, "burst-2", PROMPTS[2]))
        assert wait_for(lambda: finished(*burst), 30)
    finally:
        engine.stop()
    assert burst[0][0].queue_ms >= 280
    # one prefill step for all, then lock step (admitted apart, the first two would decode before the third had its
    # first token: burst-0, burst-1, burst-0, burst-1, ...)
    assert order == ["burst-0", "burst-1", "burst-2"] * GREEDY.max_new_tokens


def test_the_arrival_window_waits_for_as_many_as_ran_together_last(tiny_llama_dir):
    """Three requests ran together; their successors (other prompts: nothing cached), arriving 100 ms apart, are
    admitted together."""
    engine = make_engine(tiny_llama_dir, arrival_window_ms=500)
    order: list[str] = []
    engine.start()
    try:
        round_one = [add_in_order(engine, order, f"one-{i}", PROMPTS[i]) for i in range(3)]
        assert wait_for(lambda: finished(*round_one), 30)
        order.clear()
        round_two = []
        for i in range(3):
            round_two.append(add_in_order(engine, order, f"two-{i}", PROMPTS[i][::-1]))
            time.sleep(0.1)
        assert wait_for(lambda: finished(*round_two), 30)
    finally:
        engine.stop()
    assert 150 <= round_two[0][0].queue_ms < 450  # waited for the third, not the whole window
    assert order == ["two-0", "two-1", "two-2"] * GREEDY.max_new_tokens


def test_a_cache_hit_does_not_wait_out_the_arrival_window(tiny_llama_dir):
    """A request with more of its prompt cached than left to compute starts at once, even alone after an idle
    second; a lone cold one waits the whole window. The engine's waits are recorded instead of slept."""
    engine = make_engine(tiny_llama_dir, arrival_window_ms=500)
    waits: list[float] = []
    engine._cond.wait_for = lambda predicate, timeout: waits.append(timeout)

    def admit(request_id: str, prompt: list[int]) -> list[RequestOutput]:
        outputs = collect(engine, request_id, prompt, GREEDY)
        with engine._cond:
            engine._await_returning_requests()
        run_until_idle(engine)
        return outputs

    admit("cold", PROMPTS[0])
    assert waits == [0.5]
    hit = admit("hit", PROMPTS[0] + [7, 8])
    assert waits == [0.5]
    assert hit[-1].cached_tokens_l1 == 40


def test_waits_for_pages_and_bounds_running(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_pages=8, max_running_requests=3)
    # each needs pages_for(17 + 12 - 1) = 7 pages: only one fits at a time
    outputs = [collect(engine, f"r{i}", PROMPTS[2], GREEDY) for i in range(3)]
    max_running = 0
    while engine.step():
        max_running = max(max_running, len(engine.scheduler.running))
        engine.pool.check_integrity()
    assert max_running == 1
    assert all(o[-1].finish_reason == "length" and len(o) == 12 for o in outputs)
    small = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    outputs = [collect(engine, f"s{i}", [1, 2, 3], small) for i in range(5)]
    engine.step()
    assert len(engine.scheduler.running) == 3
    run_until_idle(engine)
    assert all(o[-1].finish_reason == "length" for o in outputs)


@pytest.mark.parametrize("prompt, sampling, message", [
    ([], GREEDY, "empty"),
    (list(range(512)), GREEDY, "no room"),
    ([49152], GREEDY, "token ids"),
    (list(range(200)), SamplingParams(max_new_tokens=100), "KV pages"),
])
def test_add_request_rejects_what_cannot_run(engine, prompt, sampling, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, sampling, lambda _: None)
    assert not engine.scheduler.has_work()


def test_background_loop(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    engine.start()
    try:
        assert engine.generate(PROMPTS[:2], GREEDY) == [engine_alone for engine_alone in
                                                        make_engine(tiny_llama_dir).generate(PROMPTS[:2], GREEDY)]
    finally:
        engine.stop()
    assert engine._thread is None


def test_info(engine, tiny_llama_dir, tokenizer):
    info = engine.info
    assert (info.dtype, info.max_context, info.vocab_size, info.page_size, info.eos_token_ids) == \
        ("float32", 512, len(tokenizer), 4, (2,))
    assert len(info.fingerprint) == 64
    other = make_engine(tiny_llama_dir, page_size=8, num_pages=8)
    assert other.info.fingerprint != info.fingerprint
    assert make_engine(tiny_llama_dir).info.fingerprint == info.fingerprint
    if engine.model.kernels:  # K/V of torch's ops round differently: their blocks are another namespace's
        assert make_engine(tiny_llama_dir, disable_cpu_kernels=True).info.fingerprint != info.fingerprint


def test_config_validation_and_auto_dtype():
    assert resolve_dtype(DType.AUTO, torch.device("cpu")) is torch.float32
    assert EngineConfig(dtype="bfloat16").dtype is DType.BFLOAT16
    for bad in (dict(dtype="float16"), dict(page_size=0), dict(num_pages=0, l1_cache_size_gb=0)):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
    for bad in (dict(temperature=-1), dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=0),
                dict(top_p=float("nan")), dict(top_k=-1), dict(max_new_tokens=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_background_loop_with_concurrent_adds_and_aborts(tiny_llama_dir):
    import threading

    engine = make_engine(tiny_llama_dir, max_running_requests=3)
    finals: dict[str, str] = {}
    done = threading.Event()
    long = SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True)  # ~1 request fits the pool

    def on_output(output: RequestOutput) -> None:
        if output.finish_reason is not None:
            finals[output.request_id] = output.finish_reason
            if len(finals) == 6:
                done.set()

    engine.start()
    try:
        adders = [threading.Thread(target=engine.add_request, args=(f"r{i}", PROMPTS[i % 4], long, on_output))
                  for i in range(6)]
        for thread in adders:
            thread.start()
        for thread in adders:
            thread.join()
        engine.abort("r1")
        engine.abort("r4")
        assert done.wait(60)
    finally:
        engine.stop()
    assert finals == {f"r{i}": "abort" if i in (1, 4) else "length" for i in range(6)}
    engine.check_integrity()


def test_upcast_linear_is_exact_for_gemv_rows_and_close_beyond():
    from torch.nn import functional as F

    from model_worker.model import UpcastLinear, cpu_supports_bf16, linear_class

    torch.manual_seed(0)
    linear = UpcastLinear(64, 32, dtype=torch.bfloat16)
    for rows, tolerance in ((1, 0.0), (2, 0.0), (9, 2e-2)):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias), atol=tolerance, rtol=tolerance)
    expected = torch.nn.Linear if cpu_supports_bf16() else UpcastLinear
    assert linear_class(torch.bfloat16, torch.device("cpu")) is expected


def test_packed_linear_is_close_to_f_linear_and_reads_the_packed_copy():
    from torch.nn import functional as F

    from model_worker.model import PackedLinear, linear_class

    torch.manual_seed(0)
    linear = PackedLinear(64, 48)
    linear.pack()
    for rows in (1, 2, 4, 130):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        linear.weight.zero_()  # every row count reads the packed copy, made before this
    for rows in (1, 3):
        x = torch.randn(rows, 64)
        assert not torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))
    assert linear_class(torch.float32, torch.device("cpu")) is PackedLinear


@pytest.mark.skipif(torch.get_num_threads() < 2 or not os.path.isdir("/proc/self/task"), reason="needs 2+ threads")
def test_release_openmp_threads_frees_the_callers_team():
    """`Engine.start` frees the starting thread's OpenMP team, so that libgomp does not throttle the step thread's
    (see `release_openmp_threads`)."""
    from model_worker.engine import release_openmp_threads

    def threads() -> int:
        (torch.ones(2_000_000) + 1).sum()  # a parallel region on this thread: its team exists
        return len(os.listdir("/proc/self/task"))

    with_team = threads()
    release_openmp_threads()
    assert len(os.listdir("/proc/self/task")) == with_team - (torch.get_num_threads() - 1)
