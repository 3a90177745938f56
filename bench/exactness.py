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
from typing import NamedTuple

from bench import Row
from bench.workloads import corpus_tokens
from model_worker.config import EngineConfig
from model_worker.engine import Engine
from model_worker.loader import resolve_model
from model_worker.request import RequestOutput, SamplingParams

PROMPTS = 200  # the "at least 200 prompts"
BATCH = 4  # hits sent together
NEW_TOKENS = 16
LENGTHS = (48, 199)  # prompt tokens, drawn uniformly: a few pages to a dozen, each with a partial last page


class Answer(NamedTuple):
    token_ids: list[int]
    cached_tokens: int  # prompt tokens the engine reused from its pool


@dataclass(frozen=True)
class Exactness:
    """Outputs of the same prompts, first cold and then as prefix hits; tokens as the engine reported them."""

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
    the pages they cached are still in the pool. `engine` must not be started (its steps run here)."""
    greedy = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    differ = cold_cached = hit_cached = 0
    for start in range(0, len(prompts), batch):
        group = prompts[start:start + batch]
        cold = [_generate(engine, [prompt], greedy)[0] for prompt in group]
        hits = _generate(engine, group, greedy)
        differ += sum(c.token_ids != h.token_ids for c, h in zip(cold, hits))
        cold_cached += sum(c.cached_tokens for c in cold)
        hit_cached += sum(h.cached_tokens for h in hits)
    return Exactness(len(prompts), differ, sum(map(len, prompts)), cold_cached, hit_cached)


def _generate(engine: Engine, prompts: Sequence[list[int]], sampling: SamplingParams) -> list[Answer]:
    """Runs `prompts` together to the end; their answers, in order."""
    tokens: dict[str, list[int]] = {}
    final: dict[str, RequestOutput] = {}

    def collect(output: RequestOutput) -> None:
        tokens.setdefault(output.request_id, []).extend(output.token_ids)
        if output.finish_reason is not None:
            final[output.request_id] = output

    ids = [f"exactness-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, sampling, collect)
    while len(final) < len(ids):
        if not engine.step():
            raise RuntimeError("engine idle with unfinished requests")
    return [Answer(tokens[i], final[i].cached_tokens_l1) for i in ids]


def run(dtype: str, model_dir: Path | None = None, prompts: int = PROMPTS) -> list[Row]:
    engine = Engine(model_dir or resolve_model(""), EngineConfig(dtype=dtype, kvcached=""))
    result = measure(engine, corpus_prompts(corpus_tokens(), prompts))
    what = (f"greedy outputs, {result.prompts} corpus prompts of {LENGTHS[0]}-{LENGTHS[1]} tokens, {NEW_TOKENS} new "
            f"tokens each: cold one at a time vs prefix hits {BATCH} at a time ({result.hit_cached_tokens:,} of "
            f"{result.prompt_tokens:,} prompt tokens reused by the hits, {result.cold_cached_tokens} by the cold "
            "runs): prompts whose outputs differ")
    return [Row(what, result.differ, None, "prompts", "0")]
