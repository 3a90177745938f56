"""`python -m bench quick` (`make bench`): every benchmark, baselines in the same run; tables to stdout and
`bench/results/`."""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench import engine

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("suite", choices=["quick"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    rows = engine.run(dtype=args.dtype)
    markdown = engine.table(rows, args.dtype)
    print(markdown)
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    machine = {"platform": platform.platform(), "cpus": torch.get_num_threads(), "torch": torch.__version__}
    (RESULTS / f"{stamp}.json").write_text(json.dumps(
        {"machine": machine, "config": vars(args), "engine": [asdict(r) | {"ratio": r.ratio} for r in rows]}, indent=2))
    (RESULTS / f"{stamp}.md").write_text(markdown + "\n")


if __name__ == "__main__":
    main()
