"""vLLM (CPU build) with automatic prefix caching on the workloads of `python -m bench.peers`.

Standalone: runs inside `.venv-peers/vllm` and imports nothing from radixserve.

    python run_vllm.py WORKLOADS.json RECORDS.json MODEL_DIR [--dtype float32] [--kv-cache-gb 2]

The closed loop of `bench.workloads.drive` on vLLM's engine step API: `workload.concurrency` sessions in flight,
the requests of one session in order, each added when the previous one finishes. A request's first token counts at
the `step()` that first returns output tokens for it; times are in ms from `add_request`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Pending:
    """One request in flight. `ids` is its prompt; the chained history of its session builds on it."""

    session: int
    index: int  # in the session
    ids: list[int]
    sent: float
    first: float | None = None
    first_tokens: int = 0
    last: float | None = None
    seen: int = 0
    answer: list[int] = field(default_factory=list)


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


def record(p: Pending, done: float, cached: int, first_round: int) -> Record:
    after_first = len(p.answer) - p.first_tokens
    return Record(p.session, first_round + p.index, len(p.ids), len(p.answer), cached, cached, 0, 0,
                  (p.first - p.sent) * 1e3, (p.last - p.first) * 1e3 / after_first if after_first else None,
                  (done - p.sent) * 1e3, 0.0)


class Loop:
    """The closed loop over one run of a workload. `salt` keeps runs from hitting each other's pages, as the
    `cache_salt` of our driver does."""

    def __init__(self, engine, params, workload: dict, salt: str) -> None:
        self.engine, self.params, self.salt = engine, params, salt
        self.sessions = workload["sessions"]
        self.next_session = iter(range(len(self.sessions)))
        self.in_flight: dict[str, Pending] = {}
        self.records: list[Record] = []
        self.count = 0

    def run(self, concurrency: int) -> tuple[list[Record], float]:
        started = time.perf_counter()
        for _ in range(min(concurrency, len(self.sessions))):
            self.send(next(self.next_session), 0, [])
        while self.in_flight:
            outputs = self.engine.step()
            now = time.perf_counter()
            for out in outputs:
                self.on_output(out, now)
        wall_s = time.perf_counter() - started
        return sorted(self.records, key=lambda r: (r.session, r.turn)), wall_s

    def send(self, session: int, index: int, history: list[int]) -> None:
        """Request `index` of `session`; its record's turn is the session's first round + `index`."""
        spec = self.sessions[session]
        prompt = spec["prompts"][index]
        ids = history + prompt if spec["chained"] else list(prompt)
        request_id = f"{self.salt}-{self.count}"
        self.count += 1
        self.in_flight[request_id] = Pending(session, index, ids, time.perf_counter())
        self.engine.add_request(request_id, {"prompt_token_ids": ids, "cache_salt": self.salt}, self.params)

    def on_output(self, out, now: float) -> None:
        p = self.in_flight[out.request_id]
        tokens = list(out.outputs[0].token_ids)  # cumulative
        if tokens and p.first is None:
            p.first, p.first_tokens = now, len(tokens)
        if len(tokens) > p.seen:
            p.last, p.seen, p.answer = now, len(tokens), tokens
        if not out.finished:
            return
        del self.in_flight[out.request_id]
        if p.first is None:
            raise RuntimeError(f"session {p.session} request {p.index}: no tokens")
        self.records.append(record(p, now, out.num_cached_tokens or 0, self.sessions[p.session]["first_round"]))
        if p.index + 1 < len(self.sessions[p.session]["prompts"]):
            self.send(p.session, p.index + 1, p.ids + p.answer)
        elif (session := next(self.next_session, None)) is not None:
            self.send(session, 0, [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", help="workloads JSON written by bench.peers")
    parser.add_argument("records", help="records JSON to write")
    parser.add_argument("model", help="a Hugging Face safetensors directory")
    parser.add_argument("--dtype", default="float32", help="float32: what our stack runs on a CPU without bf16")
    parser.add_argument("--kv-cache-gb", type=int, default=2, help="2: our worker's L1 (1 GiB) + kvcached's L2 (1)")
    parser.add_argument("--max-model-len", type=int, default=4096, help="covers the longest prompt and its answer")
    args = parser.parse_args()
    # NOTE: vLLM reads these when it is imported. In-process engine core: on 2 cores a second busy process only
    # competes with the model, and step() then returns right after the forward it ran.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gb))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    spec = json.loads(Path(args.workloads).read_text())
    engine_args = EngineArgs(model=args.model, dtype=args.dtype, enable_prefix_caching=True,
                             max_model_len=args.max_model_len, seed=0)
    engine = LLMEngine.from_engine_args(engine_args)
    params = SamplingParams(temperature=0, max_tokens=spec["answer_tokens"], ignore_eos=True,
                            output_kind=RequestOutputKind.CUMULATIVE)
    warm_up = {"sessions": [{"prompts": [spec["warm_up"]], "chained": False, "first_round": 0}]}
    Loop(engine, params, warm_up, "warm_up").run(1)  # first-request costs off the clock
    results = {}
    for workload in spec["workloads"]:
        records, wall_s = [], 0.0
        for repeat in range(workload["repeats"]):
            loop = Loop(engine, params, workload, f"{workload['name']}-{repeat}")
            more, seconds = loop.run(workload["concurrency"])
            records, wall_s = records + more, wall_s + seconds
        results[workload["name"]] = {"wall_s": wall_s, "records": [asdict(r) for r in records]}
        ttft = sum(r.ttft_ms for r in records) / len(records)
        print(f"vllm {workload['name']}: {len(records)} requests in {wall_s:.1f} s, TTFT mean {ttft:.0f} ms, "
              f"cached tokens {sum(r.cached_tokens for r in records)}", flush=True)
    config = engine.vllm_config
    out = {"peer": "vllm", "version": vllm.__version__, "dtype": str(config.model_config.dtype).removeprefix("torch."),
           "concurrency": "as the workload", "cached_tokens": "num_cached_tokens of each RequestOutput",
           "config": {"kv_cache_gb": args.kv_cache_gb, "max_model_len": args.max_model_len,
                      "block_size": config.cache_config.block_size,
                      "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
                      "enable_prefix_caching": config.cache_config.enable_prefix_caching,
                      "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")},
           "workloads": results}
    Path(args.records).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
