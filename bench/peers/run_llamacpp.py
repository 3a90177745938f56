"""llama.cpp (llama-cpp-python) with its prompt cache on the workloads of `python -m bench.peers`.

Standalone: runs inside `.venv-peers/llamacpp` and imports nothing from radixserve.

    python run_llamacpp.py WORKLOADS.json RECORDS.json MODEL.gguf --cache ram|disk

A `Llama` object serves one sequence at a time, so every session runs after the previous one (concurrency 1,
whatever the workload's concurrency); the requests of a session in order, as in `bench.workloads.drive`. Each
request streams `create_completion` over token ids, greedy, with every end-of-generation token biased to -inf so
the answer has exactly the fixed length. Times are in ms from the call; the first token counts at the first chunk.

Reuse in llama-cpp-python has two layers: the context keeps the last sequence's KV, so a prompt extending it only
evaluates the rest; and the cache (`LlamaRAMCache` or `LlamaDiskCache`) stores the whole state after every
completion and restores the one with the longest common prefix when it beats the context. `cached_tokens` is what
both together saved: the prompt tokens that llama.cpp did not evaluate, observed at its first `eval` call.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import llama_cpp
from llama_cpp import Llama, LlamaDiskCache, LlamaRAMCache


@dataclass(frozen=True)
class Record:  # the fields of bench.workloads.Record
    session: int
    turn: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_l1: int
    cached_tokens_l2: int
    cached_tokens_l3: int
    ttft_ms: float
    itl_ms: float | None
    e2e_ms: float
    prefetch_wait_ms: float


class RecordingLlama(Llama):
    """A `Llama` that notes, per completion, the prompt tokens it skipped and the token ids it sampled (the stream
    carries text only; a conversation's next prompt needs the ids)."""

    def generate(self, tokens, *args, **kwargs):
        self.prompt_len, self.skipped, self.sampled = len(tokens), None, []
        for token in super().generate(tokens, *args, **kwargs):
            self.sampled.append(token)
            yield token

    def eval(self, tokens) -> None:
        if self.skipped is None:  # the first eval of a completion gets the part of the prompt not reused
            self.skipped = self.prompt_len - len(tokens)
        super().eval(tokens)


def request(llm: RecordingLlama, ids: list[int], max_tokens: int, bias: dict[int, float],
            eog: set[int]) -> tuple[list[int], float, float, float | None, int, float]:
    """One streamed completion: (answer ids, ttft, first, last, tokens at the first chunk, done), times absolute."""
    sent = time.perf_counter()
    first = last = None
    first_tokens = seen = 0
    for _ in llm.create_completion(prompt=ids, max_tokens=max_tokens, temperature=0.0, stream=True,
                                   logit_bias=bias):
        now = time.perf_counter()
        if len(llm.sampled) > seen:
            seen = len(llm.sampled)
            if first is None:
                first, first_tokens = now, seen
            last = now
    done = time.perf_counter()
    if first is None:
        raise RuntimeError("no tokens")
    answer = [t for t in llm.sampled if t not in eog]  # none, with the bias; counted honestly all the same
    return answer, sent, first, last, first_tokens, done


def run_workload(llm: RecordingLlama, workload: dict, max_tokens: int, bias: dict[int, float],
                 eog: set[int]) -> tuple[list[Record], float]:
    records = []
    started = time.perf_counter()
    for s, session in enumerate(workload["sessions"]):
        history: list[int] = []
        for turn, prompt in enumerate(session["prompts"], start=session["first_round"]):
            ids = history + prompt if session["chained"] else list(prompt)
            answer, sent, first, last, first_tokens, done = request(llm, ids, max_tokens, bias, eog)
            after_first = len(llm.sampled) - first_tokens
            records.append(Record(s, turn, len(ids), len(answer), llm.skipped, llm.skipped, 0, 0,
                                  (first - sent) * 1e3, (last - first) * 1e3 / after_first if after_first else None,
                                  (done - sent) * 1e3, 0.0))
            history = ids + answer
    return records, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", help="workloads JSON written by bench.peers")
    parser.add_argument("records", help="records JSON to write")
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument("--cache", choices=["ram", "disk"], required=True)
    parser.add_argument("--cache-gb", type=int, default=2, help="2: our worker's L1 (1 GiB) + kvcached's L2 (1)")
    parser.add_argument("--threads", type=int, default=2, help="2: the cores of the benchmark machine")
    parser.add_argument("--n-ctx", type=int, default=4096, help="covers the longest prompt and its answer")
    args = parser.parse_args()
    spec = json.loads(Path(args.workloads).read_text())
    llm = RecordingLlama(model_path=args.model, n_ctx=args.n_ctx, n_threads=args.threads,
                         n_threads_batch=args.threads, seed=0, verbose=False)
    eog = {t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(llm._model.vocab, t)}
    bias = {t: float("-inf") for t in eog}
    cache_root = Path(tempfile.mkdtemp(prefix="llamacpp-disk-cache-"))

    def fresh_cache(run: str) -> None:
        """Every run of a workload starts with an empty cache, as our driver's `cache_salt` gives it; the disk
        cache in a new directory, the last run's deleted."""
        capacity = args.cache_gb << 30
        if args.cache == "ram":
            llm.set_cache(LlamaRAMCache(capacity))
            return
        shutil.rmtree(cache_root, ignore_errors=True)
        llm.set_cache(LlamaDiskCache(str(cache_root / run), capacity))

    try:
        fresh_cache("warm_up")
        warm_up = {"sessions": [{"prompts": [spec["warm_up"]], "chained": False, "first_round": 0}]}
        run_workload(llm, warm_up, spec["answer_tokens"], bias, eog)  # first-request costs off the clock
        results = {}
        for workload in spec["workloads"]:
            records, wall_s = [], 0.0
            for repeat in range(workload["repeats"]):
                fresh_cache(f"{workload['name']}-{repeat}")
                more, seconds = run_workload(llm, workload, spec["answer_tokens"], bias, eog)
                records, wall_s = records + more, wall_s + seconds
            results[workload["name"]] = {"wall_s": wall_s, "records": [asdict(r) for r in records]}
            ttft = sum(r.ttft_ms for r in records) / len(records)
            print(f"llama.cpp {args.cache} {workload['name']}: {len(records)} requests in {wall_s:.1f} s, "
                  f"TTFT mean {ttft:.0f} ms, cached tokens {sum(r.cached_tokens for r in records)}", flush=True)
    finally:
        shutil.rmtree(cache_root, ignore_errors=True)
    out = {"peer": f"llamacpp-{args.cache}", "version": llama_cpp.__version__,
           "dtype": f"{llm._model.desc().rsplit(' ', 1)[-1]} weights (as the GGUF file stores them), f16 KV cache",
           "concurrency": "1 (one sequence at a time)",
           "cached_tokens": "prompt tokens not evaluated (kept in the context or restored from the cache)",
           "config": {"cache": args.cache, "cache_gb": args.cache_gb, "threads": args.threads, "n_ctx": args.n_ctx,
                      "n_batch": llm.n_batch, "eog_tokens_biased": sorted(eog)},
           "workloads": results}
    Path(args.records).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
