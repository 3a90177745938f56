"""In-process engines for tests: tiny models and configs, stepping until idle, prefill logits through the pool."""

from __future__ import annotations

from pathlib import Path

import torch

from model_worker.attention import Chunk
from model_worker.config import EngineConfig
from model_worker.engine import Engine
from model_worker.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


def save_tiny_model(directory: Path, config, tokenizer) -> Path:
    """A random-weight float32 model of `config` (seed 0) with `tokenizer`, saved in `directory`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def make_engine(model_dir, **overrides) -> Engine:
    """A float32 engine with 64 pages of 4 tokens and no kvcached, unless `overrides` say otherwise."""
    defaults = {"page_size": 4, "num_pages": 64, "dtype": "float32", "kvcached": ""}
    return Engine(model_dir, EngineConfig(**{**defaults, **overrides}))


def prefill_logits(engine: Engine, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits of every position, prefilling `ids` through the pool `chunk` tokens at a time."""
    rows = []
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        engine.pool.ensure_capacity("probe", start + len(part))
        meta = engine.backend.prepare([Chunk(engine.pool.block_table("probe"), start, len(part))])
        rows.append(engine.model(torch.tensor(part), torch.arange(start, start + len(part)), meta,
                                 torch.arange(len(part))))
    engine.pool.release("probe")
    return torch.cat(rows)


def run_until_idle(engine: Engine) -> int:
    steps = 0
    while engine.step():
        steps += 1
    return steps
