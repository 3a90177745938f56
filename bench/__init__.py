"""Benchmarks: `python -m bench quick` (`make bench`) compares radixserve with baselines in the same run."""

from dataclasses import dataclass


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
