"""Plots of a workload run (`bench/workloads.py`): `python -m bench.report RESULTS-workloads.json` redraws one.

The input is the run's raw JSON: `{"labels": {config: legend}, "configs": {config: {workload: {"records": [record,
...]}}}}`, with each record carrying at least `turn` and `ttft_ms`. One PNG: the mean TTFT of each multi-turn round
per configuration, then a TTFT CDF per configuration for each set of configurations that ran the same workloads.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, NullFormatter

MULTI_TURN = "multi_turn"


def plot(raw: dict, path: Path) -> None:
    """Writes the panels to `path` (PNG)."""
    labels, configs = raw.get("labels", {}), raw["configs"]
    groups: dict[tuple[str, ...], list[str]] = {}  # workloads run -> the configurations that ran them
    for config, workloads in configs.items():
        groups.setdefault(tuple(sorted(workloads)), []).append(config)
    figure, (rounds, *cdfs) = plt.subplots(1, 1 + len(groups), figsize=(6 * (1 + len(groups)), 4.5))
    for config, workloads in configs.items():
        label = labels.get(config, config)
        if MULTI_TURN in workloads:
            means = round_means(workloads[MULTI_TURN]["records"])
            rounds.plot(range(1, len(means) + 1), [m / 1e3 for m in means], marker="o", label=label)
    rounds.set(title="multi-turn: mean TTFT per round", xlabel="round", ylabel="TTFT (s)")
    rounds.xaxis.get_major_locator().set_params(integer=True)
    for cdf, (workload_names, members) in zip(cdfs, groups.items()):
        for config in members:
            ttft = sorted(r["ttft_ms"] / 1e3 for w in configs[config].values() for r in w["records"])
            fractions = [(i + 1) / len(ttft) for i in range(len(ttft))]
            cdf.step(ttft, fractions, where="post", label=labels.get(config, config))
        cdf.set(title=f"TTFT CDF: {', '.join(workload_names)}", xlabel="TTFT (s)", ylabel="fraction of requests",
                xscale="log")
        cdf.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))  # 0.1, not 10^-1
        cdf.xaxis.set_minor_formatter(NullFormatter())  # within one decade they overlap
    for axes in (rounds, *cdfs):
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
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
