"""Plots of a workload run (`bench/workloads.py`): `python -m bench.report RESULTS-workloads.json` redraws one.

The input is the run's raw JSON: `{"configs": {config: {workload: {"records": [record, ...]}}}}`, with each record
carrying at least `turn` and `ttft_ms`. Two panels in one PNG: the mean TTFT of each multi-turn round per
configuration, and the TTFT CDF of every request per configuration.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

LABELS = {"off": "cache off (--disable-radix-cache)", "on": "cache on (L1+L2+L3)"}
MULTI_TURN = "multi_turn"


def plot(raw: dict, path: Path) -> None:
    """Writes the two panels to `path` (PNG)."""
    figure, (rounds, cdf) = plt.subplots(1, 2, figsize=(12, 4.5))
    for config, workloads in raw["configs"].items():
        label = LABELS.get(config, config)
        if MULTI_TURN in workloads:
            means = round_means(workloads[MULTI_TURN]["records"])
            rounds.plot(range(1, len(means) + 1), [m / 1e3 for m in means], marker="o", label=label)
        ttft = sorted(r["ttft_ms"] / 1e3 for w in workloads.values() for r in w["records"])
        cdf.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=label)
    rounds.set(title="multi-turn: mean TTFT per round", xlabel="round", ylabel="TTFT (s)")
    rounds.xaxis.get_major_locator().set_params(integer=True)
    cdf.set(title="TTFT CDF, all workloads", xlabel="TTFT (s)", ylabel="fraction of requests", xscale="log")
    cdf.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))  # 0.1, not 10^-1
    for axes in (rounds, cdf):
        axes.grid(alpha=0.3)
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def round_means(records: list[dict]) -> list[float]:
    """Mean `ttft_ms` of each turn, in turn order."""
    turns = sorted({r["turn"] for r in records})
    return [statistics.fmean(r["ttft_ms"] for r in records if r["turn"] == t) for t in turns]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw", type=Path, help="a bench/results/<stamp>-workloads.json")
    args = parser.parse_args()
    out = args.raw.with_suffix(".png")
    plot(json.loads(args.raw.read_text()), out)
    print(out)


if __name__ == "__main__":
    main()
