"""`python -m bench quick` (`make bench`): every benchmark, baselines in the same run; one table per module to stdout
and `bench/results/<stamp>.md`, every row in `bench/results/<stamp>.json`.

Each module's `run` returns rows with `name`, `ours`, `baseline` (None where there is none), `unit`, `goal`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from bench import cache, engine, exactness, lang, machine, radix_match, resolved_dtype, sampling, tiers, workloads

RESULTS = Path(__file__).resolve().parent / "results"


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def table(title: str, rows: list) -> str:
    lines = [f"| {title} | ours | baseline | unit | ratio | goal |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.name} | {_num(r.ours)} | {_num(r.baseline)} | {r.unit} | "
              f"{'' if r.ratio is None else f'{r.ratio:.2f}x'} | {r.goal} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("suite", choices=["quick", "full"], help="full: the workloads at the issue's sizes (an hour)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="auto: what the worker's --dtype auto picks on this machine")
    args = parser.parse_args()
    dtype = resolved_dtype(args.dtype)
    sizes = workloads.FULL if args.suite == "full" else workloads.Sizes()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    suites: dict[str, tuple[str, Callable[[], list]]] = {  # JSON key: (table title, run)
        "engine": (f"engine ({dtype})", lambda: engine.run(dtype=dtype)),
        "exactness": (f"outputs with and without cache hits ({dtype})", lambda: exactness.run(dtype)),
        "cache": (f"KV cache ({dtype})", lambda: cache.run(dtype)),
        "tiers": (f"disk tier L3 ({dtype})", lambda: tiers.run(dtype)),
        "radix_match": ("radix index, in process", radix_match.run),
        "workloads": ("serving workloads: each configuration vs its baseline (cache on: vs cache off)",
                      lambda: workloads.run(RESULTS / stamp, sizes, dtype)),
        "lang": (f"radixserve.lang programs vs the same calls sent one by one ({dtype})", lambda: lang.run(dtype)),
        "sampling": (f"structured output, n samples, HTTP vs gRPC ({dtype})", lambda: sampling.run(dtype)),
    }
    results, tables = {}, []
    for key, (title, run) in suites.items():
        started = time.monotonic()
        rows = run()
        tables.append(table(title, rows))
        print(tables[-1], f"\n({title}: {time.monotonic() - started:.0f} s)\n", flush=True)
        results[key] = [asdict(r) | {"ratio": r.ratio} for r in rows]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stamp}.json").write_text(json.dumps(
        {"machine": machine(), "config": vars(args) | {"dtype_resolved": dtype}, "results": results}, indent=2))
    (RESULTS / f"{stamp}.md").write_text("\n\n".join(tables) + "\n")


if __name__ == "__main__":
    main()
