"""Engine against plain transformers, same model, same dtype, same run (issue: foundation benchmark).

- decode: one request, greedy, N new tokens: tokens/s of `Engine` vs `model.generate`.
- batch: 8 concurrent requests vs one: total decode tokens/s of the engine.
- prefill: one 2,048-token prompt: our prefill vs one transformers forward of the same tokens, each warmed once on
  another 2,048-token prompt and timed at its best of `PREFILL_REPEATS` distinct prompts (a first forward of a new
  length pays one-time costs on both sides, e.g. oneDNN primitives and first-touched pages, which no serving step
  repeats). The process keeps the memory it frees, as a worker does once loaded (`keep_freed_memory`): without it a
  prefill's activations are faulted in again on some steps (0 to 76k page faults a prefill, 2,250-2,570 ms).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM

from bench import Row, engine_device
from model_worker.config import EngineConfig
from model_worker.engine import Engine
from model_worker.request import SamplingParams
from model_worker.loader import resolve_model
from radixserve.server import keep_freed_memory

PREFILL_REPEATS = 3  # the best of 3 distinct prompts: this shared host moves single runs by 10-25%


def _prompt(n: int, seed: int, vocab: int = 49152) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def _timed(fn) -> float:
    """Seconds `fn` takes, including the GPU work it queued."""
    started = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


def _warm_best(forward: Callable[[list[int]], object], prompts: list[list[int]]) -> float:
    """Seconds of the fastest `forward` of prompts[1:], after prompts[0] warmed it up."""
    forward(prompts[0])
    return min(_timed(lambda: forward(ids)) for ids in prompts[1:])


def run(dtype: str = "bfloat16", new_tokens: int = 64, prefill_tokens: int = 2048, batch: int = 8) -> list[Row]:
    model_dir = resolve_model("")
    engine = Engine(model_dir, EngineConfig(dtype=dtype, kvcached="", max_running_requests=batch,
                                            chunked_prefill_size=prefill_tokens))
    device = engine_device()  # transformers runs where the engine does
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    keep_freed_memory()  # for both: a worker's steps run so
    greedy = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    prompt = _prompt(32, 0)
    engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=4))  # warm-up both
    with torch.inference_mode():
        hf.generate(torch.tensor([prompt], device=device), max_new_tokens=4, do_sample=False)

    one = _timed(lambda: engine.generate([prompt], greedy))
    with torch.inference_mode():
        hf_one = _timed(lambda: hf.generate(torch.tensor([prompt], device=device), max_new_tokens=new_tokens,
                                            min_new_tokens=new_tokens, do_sample=False))
    prompts = [_prompt(32, i) for i in range(batch)]
    many = _timed(lambda: engine.generate(prompts, greedy))
    first_token = SamplingParams(temperature=0, max_new_tokens=1)
    longs = [_prompt(prefill_tokens, seed) for seed in range(1, PREFILL_REPEATS + 2)]  # distinct: no cache hit
    prefill = _warm_best(lambda ids: engine.generate([ids], first_token), longs)
    with torch.inference_mode():
        hf_prefill = _warm_best(lambda ids: hf(torch.tensor([ids], device=device)), longs)
    return [
        Row("single-request decode", new_tokens / one, new_tokens / hf_one, "tok/s", "ours >= transformers generate"),
        Row(f"{batch} concurrent vs 1 (engine)", batch * new_tokens / many, new_tokens / one, "tok/s", ">= 3x"),
        Row(f"prefill {prefill_tokens} tokens", 1 / prefill, 1 / hf_prefill, "prefills/s",
            "ours >= 1/1.2 of transformers forward"),
    ]
