"""Caching never changes output, measured on the bench corpus (issue: engine speed, "Outputs stay the same"): greedy
outputs of prompts cut from `bench/data/corpus.txt`, computed cold one at a time, against the same prompts again, 4
at a time, each now a prefix hit on the pages the first pass cached. In process, the default engine configuration
(the worker's defaults, no kvcached). Kernels whose result depends on the rows beside them would show here: the hits
run in a batch, over cached K/V, where the cold runs ran alone.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench import Row
from bench.workloads import corpus_tokens
from model_worker.config import EngineConfig
from model_worker.engine import Engine
from model_worker.loader import resolve_model
from model_worker.prefix_cache import CacheRequest, CacheState
from model_worker.request import SamplingParams

PROMPTS = 200  # the "at least 200 prompts"
BATCH = 4  # hits sent together
NEW_TOKENS = 16
LENGTHS = (48, 199)  # prompt tokens, drawn uniformly: a few pages to a dozen, each with a partial last page


@dataclass(frozen=True)
class Exactness:
    """Outputs of the same prompts, first cold and then as prefix hits; reused tokens as `PrefixCache.cached_tokens`
    found them cached just before each run (what admission then reuses, with no kvcached lease)."""

    prompts: int
    differ: int  # prompts whose greedy outputs were not the same token ids
    prompt_tokens: int
    cold_cached_tokens: int  # reused in the first pass (0 unless two prompts share a page)
    hit_cached_tokens: int  # reused in the second pass


def corpus_prompts(corpus: Sequence[int], count: int, seed: int = 0) -> list[list[int]]:
    """`count` slices of the corpus, of `LENGTHS` tokens, at seeded offsets."""
    rng = random.Random(seed)
    lengths = [rng.randint(*LENGTHS) for _ in range(count)]
    return [list(corpus[start:start + n]) for n, start in
            zip(lengths, (rng.randrange(len(corpus) - n) for n in lengths))]


def measure(engine: Engine, prompts: Sequence[list[int]], batch: int = BATCH,
            new_tokens: int = NEW_TOKENS) -> Exactness:
    """Each group of `batch` prompts: one at a time (cold), then together (hits), before the next group, so that
    the pages they cached are still in the pool. `engine` must not be started (`Engine.generate` steps it here)."""
    greedy = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    differ = cold_cached = hit_cached = 0
    for start in range(0, len(prompts), batch):
        group = prompts[start:start + batch]
        cold = []
        for prompt in group:
            cold_cached += _cached(engine, prompt)
            cold += engine.generate([prompt], greedy)
        hit_cached += sum(_cached(engine, prompt) for prompt in group)
        differ += sum(c != h for c, h in zip(cold, engine.generate(list(group), greedy)))
    return Exactness(len(prompts), differ, sum(map(len, prompts)), cold_cached, hit_cached)


def _cached(engine: Engine, prompt: list[int]) -> int:
    return engine.prefix.cached_tokens(prompt, CacheState(CacheRequest()))


def run(dtype: str, model_dir: Path | None = None, prompts: int = PROMPTS) -> list[Row]:
    engine = Engine(model_dir or resolve_model(""), EngineConfig(dtype=dtype, kvcached=""))
    result = measure(engine, corpus_prompts(corpus_tokens(), prompts))
    what = (f"greedy outputs, {result.prompts} corpus prompts of {LENGTHS[0]}-{LENGTHS[1]} tokens, {NEW_TOKENS} new "
            f"tokens each: cold one at a time vs prefix hits {BATCH} at a time ({result.hit_cached_tokens:,} of "
            f"{result.prompt_tokens:,} prompt tokens reused by the hits, {result.cold_cached_tokens} by the cold "
            "runs): prompts whose outputs differ")
    return [Row(what, result.differ, None, "prompts", "0")]
