"""Serving workloads through the real stack (issue: benchmarks that prove it). `python -m bench quick` runs them;
`python -m bench.workloads [--rate R]` runs them alone.

A load driver over grpc.aio sends seeded workloads cut from `bench/data/corpus.txt` to two routers in front of the
same worker, so both configurations share one model, one machine and one run:

    router_off (--disable-radix-cache) ──┐
                                         ├──► worker ──► kvcached (L2 in shared memory, L3 in LMDB)
    router_on  (L1 + L2 + L3 defaults) ──┘

Workloads (token ids sliced from the tokenized corpus at seeded, distinct offsets; greedy, fixed answer length):

- multi_turn: conversations of several rounds; round 1 is a base prompt and a user turn, each later round appends the
  previous answer and a new user turn. Conversations run concurrently, the rounds of one in order.
- long_document: documents of a few thousand tokens, several questions about each, asked one after another.
- shared_prefix: groups of users sharing a long system prompt, interleaved across groups.
- no_reuse: unrelated prompts, so the cache never hits: what it costs when it cannot help.

Each workload runs off, then on, under its own `cache_salt`, so no workload hits pages another one computed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import numpy as np

from bench import Row, report
from kvcached.tiers.dram_shm import SEGMENT_PREFIX, cleanup_stale_segments
from model_worker.loader import resolve_model
from radixserve.v1 import router_pb2, router_pb2_grpc
from router.tokenizer import PromptTokenizer
from tests.stack import Processes

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = ("off", "on")  # the baseline first: it leaves nothing cached behind it
REQUEST_TIMEOUT_S = 600


@dataclass(frozen=True)
class Sizes:
    """Workload sizes. The defaults are the quick suite: about 30k uncached prompt tokens per configuration, which
    a 2-core host prefills in roughly three minutes in float32; the cached configuration needs a third of that."""

    conversations: int = 4
    rounds: int = 5
    base_tokens: int = 512
    user_tokens: int = 28
    documents: tuple[int, ...] = (1500, 2000)
    questions: int = 3
    question_tokens: int = 24
    groups: int = 2
    users_per_group: int = 3
    system_tokens: int = 640
    random_prompts: int = 8
    random_tokens: int = 256
    answer_tokens: int = 16  # long enough for inter-token latency, short enough that prefill dominates


@dataclass(frozen=True)
class Session:
    """Requests sent in order, each once the previous one has finished. `chained`: request i's prompt is request
    i-1's prompt + its answer + `prompts[i]` (a conversation); otherwise each prompt is sent as it is."""

    prompts: tuple[tuple[int, ...], ...]
    chained: bool = False


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    concurrency: int  # sessions in flight in the closed loop


@dataclass(frozen=True)
class Record:
    """One request as the client saw it. Times in ms from sending the request; usage and prefetch wait as the
    router reported them on the last message."""

    session: int
    turn: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_l1: int
    cached_tokens_l2: int
    cached_tokens_l3: int
    ttft_ms: float  # to the first streamed message carrying tokens
    itl_ms: float | None  # mean gap per token after the first message; None with nothing after it
    e2e_ms: float
    prefetch_wait_ms: float


@dataclass(frozen=True)
class Load:
    records: tuple[Record, ...]
    wall_s: float


# -- workloads ---------------------------------------------------------------------------------------------------
def corpus_tokens() -> list[int]:
    """The bundled corpus as the router encodes text for the default model (no stack needed)."""
    return PromptTokenizer(resolve_model("")).encode_text(CORPUS.read_text())


def build(corpus: list[int], sizes: Sizes, seed: int = 0) -> list[Workload]:
    """The four workloads, the same for the same corpus, sizes and seed."""
    rng = random.Random(seed)
    return [multi_turn(corpus, sizes, rng), long_document(corpus, sizes, rng), shared_prefix(corpus, sizes, rng),
            no_reuse(corpus, sizes, rng)]


def _slices(corpus: list[int], rng: random.Random, n: int, length: int) -> list[tuple[int, ...]]:
    """`n` slices of `length` tokens at distinct offsets, so no two share a first page by accident."""
    if length >= len(corpus):
        raise ValueError(f"a {length}-token slice does not fit a {len(corpus)}-token corpus")
    return [tuple(corpus[o:o + length]) for o in rng.sample(range(len(corpus) - length), n)]


def multi_turn(corpus: list[int], sizes: Sizes, rng: random.Random) -> Workload:
    sessions = []
    for base in _slices(corpus, rng, sizes.conversations, sizes.base_tokens):
        first, *later = _slices(corpus, rng, sizes.rounds, sizes.user_tokens)
        sessions.append(Session((base + first, *later), chained=True))
    return Workload("multi_turn", tuple(sessions), concurrency=sizes.conversations)


def long_document(corpus: list[int], sizes: Sizes, rng: random.Random) -> Workload:
    sessions = []
    for document in [_slices(corpus, rng, 1, length)[0] for length in sizes.documents]:
        questions = _slices(corpus, rng, sizes.questions, sizes.question_tokens)
        sessions.append(Session(tuple(document + q for q in questions)))
    return Workload("long_document", tuple(sessions), concurrency=len(sessions))


def shared_prefix(corpus: list[int], sizes: Sizes, rng: random.Random) -> Workload:
    systems = _slices(corpus, rng, sizes.groups, sizes.system_tokens)
    questions = [_slices(corpus, rng, sizes.users_per_group, sizes.question_tokens) for _ in systems]
    # User-major order: each group's first user is in flight before its second one is sent.
    sessions = tuple(Session((system + qs[user],)) for user in range(sizes.users_per_group)
                     for system, qs in zip(systems, questions))
    return Workload("shared_prefix", sessions, concurrency=sizes.groups)


def no_reuse(corpus: list[int], sizes: Sizes, rng: random.Random) -> Workload:
    prompts = _slices(corpus, rng, sizes.random_prompts, sizes.random_tokens)
    return Workload("no_reuse", tuple(Session((p,)) for p in prompts), concurrency=4)  # a batch, as in multi_turn


# -- load driver -------------------------------------------------------------------------------------------------
async def drive(stub: router_pb2_grpc.RouterStub, workload: Workload, sampling: router_pb2.SamplingParams, salt: str,
                rate: float | None = None, seed: int = 0) -> Load:
    """Runs every session of `workload` and returns its records, session by session. Closed loop with
    `workload.concurrency` sessions in flight, or, with `rate`, sessions started at Poisson arrivals of `rate` per
    second (open loop, unbounded concurrency)."""
    results: list[list[Record]] = [[] for _ in workload.sessions]

    async def run_session(i: int) -> None:
        results[i] = await _session(stub, i, workload.sessions[i], sampling, salt)

    started = time.perf_counter()
    if rate is None:
        await _closed_loop(run_session, len(workload.sessions), workload.concurrency)
    else:
        await _poisson(run_session, len(workload.sessions), rate, random.Random(seed))
    return Load(tuple(r for session in results for r in session), time.perf_counter() - started)


async def _closed_loop(run: Callable[[int], Awaitable[None]], n: int, concurrency: int) -> None:
    pending = iter(range(n))  # shared by the slots: each takes the next session when its last one is done

    async def slot() -> None:
        for i in pending:
            await run(i)

    await asyncio.gather(*(slot() for _ in range(min(concurrency, n))))


async def _poisson(run: Callable[[int], Awaitable[None]], n: int, rate: float, rng: random.Random) -> None:
    tasks = []
    for i in range(n):
        if i:
            await asyncio.sleep(rng.expovariate(rate))
        tasks.append(asyncio.create_task(run(i)))
    await asyncio.gather(*tasks)


async def _session(stub: router_pb2_grpc.RouterStub, index: int, session: Session,
                   sampling: router_pb2.SamplingParams, salt: str) -> list[Record]:
    records, history = [], ()
    for turn, prompt in enumerate(session.prompts):
        ids = history + prompt if session.chained else prompt
        record, answer = await _request(stub, ids, sampling, salt, index, turn)
        records.append(record)
        history = ids + answer
    return records


async def _request(stub: router_pb2_grpc.RouterStub, ids: tuple[int, ...], sampling: router_pb2.SamplingParams,
                   salt: str, session: int, turn: int) -> tuple[Record, tuple[int, ...]]:
    """One streamed Generate; returns its record and the answer's token ids."""
    request = router_pb2.GenerateRequest(token_ids=ids, sampling=sampling, stream=True, cache_salt=salt)
    answer: list[int] = []
    first = last = None
    final = router_pb2.GenerateResponse()  # the last message carries usage and timings
    sent = time.perf_counter()
    async for final in stub.Generate(request, timeout=REQUEST_TIMEOUT_S):
        if final.token_ids:
            last = time.perf_counter()
            if first is None:
                first, first_tokens = last, len(final.token_ids)
            answer.extend(final.token_ids)
    done = time.perf_counter()
    if first is None:
        raise RuntimeError(f"session {session} turn {turn}: no tokens, finish_reason {final.finish_reason!r}")
    usage = final.usage
    after_first = len(answer) - first_tokens
    return Record(session, turn, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens,
                  usage.cached_tokens_l1, usage.cached_tokens_l2, usage.cached_tokens_l3, (first - sent) * 1e3,
                  (last - first) * 1e3 / after_first if after_first else None, (done - sent) * 1e3,
                  final.timings.prefetch_wait_ms), tuple(answer)


# -- metrics -----------------------------------------------------------------------------------------------------
def metrics(load: Load) -> dict[str, tuple[float, str]]:
    """Summary of one load: name -> (value, unit). The hit ratio is cached over prompt tokens, all tiers."""
    ttft = [r.ttft_ms for r in load.records]
    itl = [r.itl_ms for r in load.records if r.itl_ms is not None]
    p50, p90, p99 = map(float, np.percentile(ttft, [50, 90, 99]))
    return {
        "TTFT mean": (statistics.fmean(ttft), "ms"), "TTFT p50": (p50, "ms"), "TTFT p90": (p90, "ms"),
        "TTFT p99": (p99, "ms"), "inter-token latency mean": (statistics.fmean(itl) if itl else float("nan"), "ms"),
        "e2e p50": (float(np.percentile([r.e2e_ms for r in load.records], 50)), "ms"),
        "throughput": (len(load.records) / load.wall_s, "req/s"),
        "output throughput": (sum(r.completion_tokens for r in load.records) / load.wall_s, "tok/s"),
        "hit ratio": (sum(r.cached_tokens for r in load.records) / sum(r.prompt_tokens for r in load.records), ""),
        "prefetch wait mean": (statistics.fmean(r.prefetch_wait_ms for r in load.records), "ms"),
    }


def tier_tokens(load: Load) -> dict[str, int]:
    return {tier: sum(getattr(r, f"cached_tokens_{tier}") for r in load.records) for tier in ("l1", "l2", "l3")}


# The headline ratios of the issue (cache on / cache off); other rows are context. A round is a session's n-th request.
GOALS = {("multi_turn", "throughput"): ">= 1.5x", ("multi_turn", "round 5 TTFT mean"): "<= 0.25x",
         ("long_document", "TTFT p50"): "<= 0.5x", ("shared_prefix", "TTFT p50"): "<= 0.5x",
         ("no_reuse", "TTFT mean"): "<= 1.10x (overhead)", ("no_reuse", "throughput"): ">= 0.90x (overhead)"}


def rows(name: str, off: Load, on: Load) -> list[Row]:
    """Cache on as `ours`, cache off as `baseline`; where sessions send several requests, also one row per round."""
    summary_on, summary_off = metrics(on), metrics(off)
    out = [Row(f"{name}: {metric}", value, summary_off[metric][0], unit, GOALS.get((name, metric), ""))
           for metric, (value, unit) in summary_on.items()]
    if any(r.turn for r in on.records):
        by_round = zip(*(report.round_means([asdict(r) for r in load.records]) for load in (on, off)))
        out += [Row(f"{name}: round {t} TTFT mean", a, b, "ms", GOALS.get((name, f"round {t} TTFT mean"), ""))
                for t, (a, b) in enumerate(by_round, start=1)]
    return out


# -- the run -----------------------------------------------------------------------------------------------------
def run(out_prefix: Path, sizes: Sizes = Sizes(), rate: float | None = None, seed: int = 0) -> list[Row]:
    """Starts the stack in a temporary directory, runs every workload off then on, and writes every request to
    `<out_prefix>-workloads.json` and the plots to `<out_prefix>-workloads.png`. Process logs are kept on failure."""
    log_dir = Path(tempfile.mkdtemp(prefix="radixserve-bench-workloads-"))
    try:
        loads = measure_stack(log_dir, build(corpus_tokens(), sizes, seed), sizes, rate, seed)
    except BaseException as e:
        e.add_note(f"process logs: {log_dir}")
        raise
    shutil.rmtree(log_dir)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    raw = {"sizes": asdict(sizes), "rate": rate, "seed": seed,
           "configs": {c: {w: {"wall_s": load.wall_s, "tier_tokens": tier_tokens(load),
                               "records": [asdict(r) for r in load.records]} for w, load in by_workload.items()}
                       for c, by_workload in loads.items()}}
    Path(f"{out_prefix}-workloads.json").write_text(json.dumps(raw, indent=1))
    report.plot(raw, Path(f"{out_prefix}-workloads.png"))
    return [row for w in loads["on"] for row in rows(w, loads["off"][w], loads["on"][w])]


def measure_stack(log_dir: Path, workloads: list[Workload], sizes: Sizes, rate: float | None = None,
                  seed: int = 0) -> dict[str, dict[str, Load]]:
    """{config: {workload: load}} from one stack (kvcached, one worker, a router per configuration in `CONFIGS`),
    every workload run off then on. Process logs go to `log_dir`."""
    processes = Processes(log_dir)
    try:
        kvcached = processes.kvcached(args=["--host-cache-size-gb", "1"])
        worker = processes.worker(kvcached, args=["--l1-cache-size-gb", "1"])
        routers = {"off": processes.router([worker], kvcached, "router_off", ["--disable-radix-cache"]),
                   "on": processes.router([worker], kvcached, "router_on")}
        return asyncio.run(_all(routers, workloads, sizes, rate, seed))
    finally:
        processes.stop()
        cleanup_stale_segments(SEGMENT_PREFIX)  # only a daemon killed past its grace leaves one


async def _all(routers: dict[str, str], workloads: list[Workload], sizes: Sizes, rate: float | None,
               seed: int) -> dict[str, dict[str, Load]]:
    sampling = router_pb2.SamplingParams(temperature=0, max_new_tokens=sizes.answer_tokens, ignore_eos=True)
    channels = {c: grpc.aio.insecure_channel(address) for c, address in routers.items()}
    try:
        stubs = {c: router_pb2_grpc.RouterStub(channel) for c, channel in channels.items()}
        warm_up = Workload("warm_up", (Session((tuple(range(1000, 1064)),)),), concurrency=1)
        for stub in stubs.values():  # first-request costs (lazy init, allocator) off the clock
            await drive(stub, warm_up, sampling, salt="warm_up")
        loads: dict[str, dict[str, Load]] = {c: {} for c in CONFIGS}
        for workload in workloads:
            for config in CONFIGS:
                load = await drive(stubs[config], workload, sampling, salt=workload.name, rate=rate, seed=seed)
                loads[config][workload.name] = load
                print(f"{workload.name} cache {config}: {len(load.records)} requests in {load.wall_s:.1f} s, "
                      f"TTFT mean {metrics(load)['TTFT mean'][0]:.0f} ms, cached tokens {tier_tokens(load)}",
                      flush=True)
        return loads
    finally:
        for channel in channels.values():
            await channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, help="Poisson arrivals of sessions per second (default: closed loop)")
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    args = parser.parse_args()
    out_prefix = RESULTS / time.strftime("%Y%m%d-%H%M%S")
    for row in run(out_prefix, rate=args.rate, seed=args.seed):
        print(f"{row.name}: {row.ours:.3g} vs {row.baseline:.3g} {row.unit}  {row.goal}")
    print(f"records and plots: {out_prefix}-workloads.json, .png")


if __name__ == "__main__":
    main()
