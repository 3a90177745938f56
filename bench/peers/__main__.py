"""`python -m bench.peers` (`make bench-peers`): our stack and its peers on the same workloads, one table.

Systems (columns): radixserve with its cache and with `--disable-radix-cache` (`bench.workloads.measure_stack`),
vLLM's CPU build with automatic prefix caching, and llama.cpp (llama-cpp-python) with its RAM and its disk prompt
cache. Each peer runs in `.venv-peers/<venv>/` (made by `make bench-peers`) through its runner script; see the
package docstring for the files they exchange. The table lands in `bench/results/<stamp>-peers.md`, every record
and the configuration in `<stamp>-peers.json`. A peer that fails leaves its log and a "-" column; the run goes on
and exits 1 at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

from bench import machine, resolved_dtype
from bench.peers import Summary, loads_from_json, loads_to_json, summarize, table, workloads_json
from bench.workloads import CONFIGS, RESULTS, Sizes, build, corpus_tokens, measure_stack
from model_worker.loader import default_gguf, resolve_model

HERE = Path(__file__).resolve().parent
VENVS = HERE.parent.parent / ".venv-peers"


@dataclass(frozen=True)
class Peer:
    label: str  # the table's column
    venv: str  # under .venv-peers/
    script: str  # beside this file
    model: str  # "hf": the converted safetensors directory; "gguf": the GGUF file it was converted from
    args: tuple[str, ...] = ()


PEERS = {
    "vllm": Peer("vLLM APC", "vllm", "run_vllm.py", "hf"),
    "llamacpp-ram": Peer("llama.cpp RAM cache", "llamacpp", "run_llamacpp.py", "gguf", ("--cache", "ram")),
    "llamacpp-disk": Peer("llama.cpp disk cache", "llamacpp", "run_llamacpp.py", "gguf", ("--cache", "disk")),
}
OURS = {"on": "radixserve", "off": "radixserve --disable-radix-cache"}  # configurations of bench.workloads
STACK = tuple(c for c in CONFIGS if c.name in OURS)


def run_peer(python: Path, script: Path, workloads: Path, out: Path, model: Path, args: tuple[str, ...],
             log: Path, timeout_s: float) -> dict:
    """Runs one runner to completion and returns its records file; the log (stdout and stderr) stays in `log`."""
    with open(log, "wb") as f:
        subprocess.run([str(python), str(script), str(workloads), str(out), str(model), *args], stdout=f,
                       stderr=subprocess.STDOUT, check=True, timeout=timeout_s)
    return json.loads(out.read_text())


def model_path(kind: str) -> Path:
    return resolve_model("") if kind == "hf" else default_gguf()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", nargs="+", choices=list(PEERS), default=list(PEERS), help="default: all")
    parser.add_argument("--skip-ours", action="store_true", help="peers only (iterating on a runner)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--timeout-s", type=float, default=3600, help="per peer; vLLM compiles its model first")
    args = parser.parse_args()
    sizes = Sizes()
    workloads = [w for w in build(corpus_tokens(), sizes, args.seed) if all(w.name in c.workloads for c in STACK)]
    work = Path(tempfile.mkdtemp(prefix="radixserve-bench-peers-"))
    spec = work / "workloads.json"
    spec.write_text(json.dumps(workloads_json(workloads, sizes)))
    started = time.monotonic()
    columns: dict[str, Summary] = {}
    systems: dict[str, dict] = {}
    failed: list[str] = []

    if not args.skip_ours:
        t0 = time.monotonic()
        dtype = resolved_dtype()
        loads = measure_stack(work, workloads, sizes, configs=STACK, dtype=dtype)
        for config, label in OURS.items():
            columns[label] = summarize(loads[config])
            systems[label] = {"version": version("radixserve"), "dtype": dtype, "concurrency": "as the workload",
                              "cached_tokens": "usage.cached_tokens (L1 + L2 + L3)",
                              "run_s": time.monotonic() - t0, "workloads": loads_to_json(loads[config])}
        print(f"radixserve: {time.monotonic() - t0:.0f} s", flush=True)

    for name in args.peers:
        peer = PEERS[name]
        t0 = time.monotonic()
        log = work / f"{name}.log"
        try:
            raw = run_peer(VENVS / peer.venv / "bin" / "python", HERE / peer.script, spec, work / f"{name}.json",
                           model_path(peer.model), peer.args, log, args.timeout_s)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
            print(f"{name} failed ({e}); its log: {log}", file=sys.stderr, flush=True)
            failed.append(name)
            columns[peer.label] = {}
            systems[peer.label] = {"failed": str(e), "log": str(log)}
            continue
        columns[peer.label] = summarize(loads_from_json(raw))
        systems[peer.label] = raw | {"run_s": time.monotonic() - t0}
        print(f"{name}: {time.monotonic() - t0:.0f} s", flush=True)

    wall_s = time.monotonic() - started
    stamp = time.strftime("%Y%m%d-%H%M%S")
    text = report(columns, systems, wall_s)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stamp}-peers.md").write_text(text)
    (RESULTS / f"{stamp}-peers.json").write_text(json.dumps(
        {"machine": machine(), "wall_s": wall_s,
         "config": {"sizes": asdict(sizes), "seed": args.seed, "peers": args.peers, "skip_ours": args.skip_ours},
         "systems": systems}, indent=1))
    print(f"tables and records: {RESULTS / stamp}-peers.md, .json")
    if failed:
        print(f"failed: {', '.join(failed)}; logs kept in {work}", file=sys.stderr)
        sys.exit(1)
    shutil.rmtree(work)


def report(columns: dict[str, Summary], systems: dict[str, dict], wall_s: float) -> str:
    notes = []
    for label, system in systems.items():
        if "failed" in system:
            notes.append(f"- {label}: failed ({system['failed']}), log {system['log']}")
        else:
            notes.append(f"- {label}: version {system['version']}, {system['dtype']}, concurrency "
                         f"{system['concurrency']}, cached tokens: {system['cached_tokens']}, "
                         f"{system['run_s']:.0f} s" + (f", {system['config']}" if "config" in system else ""))
    return (f"## Peers on the serving workloads ({os.cpu_count()} CPUs, run {wall_s:.0f} s)\n\n"
            f"{table(columns)}\n\n{HOW}\n" + "\n".join(notes) + "\n")


HOW = ("Same prompts (token ids), greedy, fixed answer length, a warm-up request off the clock. radixserve is timed "
       "by a gRPC client through its router; the peers in their runner's process through their Python APIs (no "
       "server in between). Hit ratio: cached over prompt tokens, as each system counts cached tokens (below).")


if __name__ == "__main__":
    main()
