"""Token sampling: greedy at temperature 0, else temperature, top-k, top-p with a per-request generator.

Every row is sampled on its own from its own `torch.Generator`, so a seeded request draws the same tokens whatever
else shares its batch. Greedy rows (the common case) are one batched argmax. A temperature below `SAMPLING_EPS` is
greedy: dividing by it would overflow float32 to inf and softmax to NaN. A row that cannot be sampled (logits not
finite) fails alone: its token is None, and the rows beside it are unaffected.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

SAMPLING_EPS = 1e-5  # below this temperature sampling is greedy (vLLM uses the same threshold)


@dataclass(frozen=True)
class SamplingRow:
    """How to draw one row: `temperature` 0 means greedy; `top_k` 0 and `top_p` 1.0 mean off."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None  # None only for greedy rows

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from `seed`, or from fresh OS randomness when `seed` is None."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int | None]:
    """One token id per row of `logits` [len(rows), vocab] (float32); None for a row whose logits are not finite."""
    tokens: list[int | None] = logits.argmax(dim=-1).tolist()
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    for i, row in enumerate(rows):
        if not finite[i]:
            tokens[i] = None
        elif not row.greedy:
            tokens[i] = sample_row(logits[i], row)
    return tokens


def sample_row(logits: torch.Tensor, row: SamplingRow) -> int:
    """Draws from softmax(logits / temperature) restricted to the top-k, then to the top-p nucleus."""
    sorted_logits, order = torch.sort(logits.float() / row.temperature, descending=True)
    if 0 < row.top_k < sorted_logits.numel():
        sorted_logits = sorted_logits[:row.top_k]
    probs = torch.softmax(sorted_logits, dim=-1)
    if row.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (always at least the most likely token)
        outside = (probs.cumsum(-1) - probs) >= row.top_p
        probs = probs.masked_fill(outside, 0.0)
    choice = torch.multinomial(probs, 1, generator=row.generator)
    return int(order[choice])
