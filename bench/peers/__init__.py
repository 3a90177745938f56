"""Peers on our serving workloads: `python -m bench.peers` (`make bench-peers`).

Each peer runs in its own virtual environment (`.venv-peers/<venv>/`, made by `make bench-peers`) through a
standalone runner script beside this file, on the workloads `bench.workloads.build` makes for our own stack. The
runner and this package talk through two JSON files:

- workloads, written here: `{"answer_tokens": N, "warm_up": [ids], "workloads": [{"name", "concurrency", "repeats",
  "sessions": [{"prompts": [[ids], ...], "chained": bool, "first_round": r}, ...]}, ...]}`. A chained session is
  a conversation: request i's prompt is request i-1's prompt + its answer + `prompts[i]`; request i is round
  `first_round + i` (a record's `turn`). Greedy, exactly N answer tokens. A workload runs `repeats` times, each
  time with nothing cached from another run (our driver gives each run its own `cache_salt`); the records of
  all runs make one load, their wall times add up.
- records, written by a runner: `{"peer", "version", "dtype", "concurrency", "cached_tokens" (what the peer's
  count means), "config", "workloads": {name: {"wall_s": s, "records": [{the fields of bench.workloads.Record}]}}}`.

This module is the pure part (the JSON both ways, the summary rows, the table); `__main__` runs the processes.
"""

from __future__ import annotations

import math
from dataclasses import asdict

from bench import report
from bench.workloads import Load, Record, Sizes, Workload, metrics

# The warm-up request of `bench.workloads.measure_stack`: first-request costs off the clock, for every system.
WARM_UP = tuple(range(1000, 1064))
# The rows of the table, per workload; where sessions send several requests, also the first and last round.
METRICS = ("TTFT mean", "TTFT p50", "TTFT p99", "inter-token latency mean", "throughput", "output throughput",
           "hit ratio")

Summary = dict[str, tuple[float, str]]  # "workload: metric" -> (value, unit)


def workloads_json(workloads: list[Workload], sizes: Sizes) -> dict:
    return {"answer_tokens": sizes.answer_tokens, "warm_up": list(WARM_UP),
            "workloads": [{"name": w.name, "concurrency": w.concurrency, "repeats": w.repeats,
                           "sessions": [{"prompts": [list(p) for p in s.prompts], "chained": s.chained,
                                         "first_round": s.first_round} for s in w.sessions]} for w in workloads]}


def loads_from_json(raw: dict) -> dict[str, Load]:
    """A runner's records file as {workload: Load}; a record missing a field of `Record` raises TypeError."""
    return {name: Load(tuple(Record(**r) for r in w["records"]), w["wall_s"]) for name, w in raw["workloads"].items()}


def loads_to_json(loads: dict[str, Load]) -> dict:
    return {name: {"wall_s": load.wall_s, "records": [asdict(r) for r in load.records]}
            for name, load in loads.items()}


def summarize(loads: dict[str, Load]) -> Summary:
    out: Summary = {}
    for name, load in loads.items():
        summary = metrics(load)
        out |= {f"{name}: {m}": summary[m] for m in METRICS}
        rounds = report.round_means([asdict(r) for r in load.records])
        if len(rounds) > 1:
            out[f"{name}: round 1 TTFT mean"] = (rounds[0], "ms")
            out[f"{name}: round {len(rounds)} TTFT mean"] = (rounds[-1], "ms")
    return out


def _num(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"


def table(columns: dict[str, Summary]) -> str:
    """One row per "workload: metric" (in order of first appearance), one column per system; an empty summary
    (a system that failed) shows as "-" throughout."""
    names: dict[str, str] = {}  # row -> unit, ordered
    for summary in columns.values():
        names |= {row: unit for row, (_, unit) in summary.items() if row not in names}
    lines = ["| workload: metric | unit | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
    for row, unit in names.items():
        cells = [_num(s[row][0]) if row in s else "-" for s in columns.values()]
        lines.append(f"| {row} | {unit} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
