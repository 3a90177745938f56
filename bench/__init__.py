"""Benchmarks: `python -m bench quick` (`make bench`) compares radixserve with baselines in the same run."""

from dataclasses import dataclass

import torch

from model_worker.engine import DType, resolve_dtype


@dataclass(frozen=True)
class Row:
    """One benchmark result; `baseline` None where there is nothing to compare against in the same run."""

    name: str
    ours: float
    baseline: float | None
    unit: str
    goal: str

    @property
    def ratio(self) -> float | None:
        return self.ours / self.baseline if self.baseline else None


def engine_device() -> torch.device:
    """Where a worker runs on this machine; in-process baselines run there too."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolved_dtype(name: str = "auto") -> str:
    """The dtype a worker started with `--dtype name` runs in on this machine, e.g. "float32"."""
    return str(resolve_dtype(DType(name), engine_device())).removeprefix("torch.")
