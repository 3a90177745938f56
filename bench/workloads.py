"""Serving workloads through the real stack (issue: benchmarks that prove it). `python -m bench quick` runs them;
`python -m bench.workloads [--rate R] [--full]` runs them alone.

A load driver over grpc.aio sends seeded workloads cut from `bench/data/corpus.txt` to one router per configuration
(`CONFIGS`). Configurations with the same cache sizes share one kvcached and one worker, so they share one model, one
machine and one run:

    router_off (--disable-radix-cache) ──┐
                                         ├──► worker_0 ──► kvcached_0 (roomy: every workload fits in L1)
    router_on  (L1 + L2 + L3 defaults) ──┘
    router_l2 ───────────────────────────────► worker_1 ──► kvcached_1 (tight L1 and L2, no disk tier)
    router_l3_<policy> (3 prefetch policies) ─► worker_2 ──► kvcached_2 (tight L1 and L2, with the disk tier)

and, as the floor, plain transformers `generate` in this process on the multi-turn and no-reuse prompts, one request
at a time.

Workloads (token ids sliced from the tokenized corpus at seeded, distinct offsets; greedy, fixed answer length):

- multi_turn: conversations of several rounds; round 1 is a base prompt and a user turn, each later round appends the
  previous answer and a new user turn. Conversations run concurrently, the rounds of one in order.
- long_document: documents of a few thousand tokens, several questions about each, asked one after another.
- shared_prefix: groups of users sharing a long system prompt, interleaved across groups.
- no_reuse: unrelated prompts, so the cache never hits: what it costs when it cannot help. It runs twice, off on on
  off, so that drift over the run cancels out of a difference this small.
- revisit: documents asked about in passes, each pass visiting every document in a seeded order, so that between two
  visits of a document come the others; they outgrow the tight L1 and L2, so a revisit is served from L2, from L3, or
  recomputed. Runs on the tight stacks only; a "round" of it is a pass.

Each workload (and each repeat) runs under its own `cache_salt`, so no run hits pages another one computed.
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import grpc
import numpy as np
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from bench import Row, engine_device, report, resolved_dtype
from kvcached.tiers.dram_shm import cleanup_stale_segments
from model_worker.loader import resolve_model
from radixserve.launch import LocalServices
from radixserve.v1 import router_pb2, router_pb2_grpc
from router.tokenizer import PromptTokenizer

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
RESULTS = Path(__file__).resolve().parent / "results"
REQUEST_TIMEOUT_S = 600
MAIN_WORKLOADS = ("multi_turn", "long_document", "shared_prefix", "no_reuse")


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
    no_reuse_repeats: int = 2
    revisit_documents: int = 5  # ~5,200 tokens: 1.5x the tight L2, 8x the tight L1's room beside 2 requests
    revisit_tokens: int = 1024
    revisit_passes: int = 2
    answer_tokens: int = 16  # long enough for inter-token latency, short enough that prefill dominates


FULL = Sizes(conversations=8, rounds=10, documents=(3200,) * 20, groups=4, users_per_group=8, random_prompts=32,
             revisit_documents=12, revisit_passes=4)  # the shapes; about an hour on 2 cores


@dataclass(frozen=True)
class Tiers:
    """Cache sizes of one stack: the worker's L1 pool, kvcached's L2 pool, and whether kvcached has its disk tier."""

    l1_gb: float
    l2_gb: float
    l3: bool


ROOMY = Tiers(l1_gb=1.0, l2_gb=1.0, l3=True)
# Room for the 2 revisit requests in flight plus ~600 tokens in L1, and ~3,400 tokens (3 documents) in L2.
TIGHT = Tiers(l1_gb=0.12, l2_gb=0.15, l3=False)
TIGHT_L3 = replace(TIGHT, l3=True)


@dataclass(frozen=True)
class Config:
    """One configuration under test: a router with `router_args` in front of a stack with `tiers`, running
    `workloads`; its rows compare it with the configuration named `baseline` (None: it is a baseline)."""

    name: str
    label: str
    tiers: Tiers
    workloads: tuple[str, ...]
    router_args: tuple[str, ...] = ()
    baseline: str | None = None


def _policy(policy: str) -> Config:
    return Config(f"l3_{policy}", f"L1+L2+L3, {policy}", TIGHT_L3, ("revisit",), ("--prefetch-policy", policy), "l2")


CONFIGS = (
    Config("off", "cache off (--disable-radix-cache)", ROOMY, MAIN_WORKLOADS, ("--disable-radix-cache",)),
    Config("on", "cache on (L1+L2+L3)", ROOMY, MAIN_WORKLOADS, baseline="off"),
    Config("l2", "L1+L2, no disk tier", TIGHT, ("revisit",)),
    *(_policy(p) for p in ("wait_complete", "best_effort", "timeout")),
)
# No stack: in process, on the workloads that bound the others: most reuse, and none (it takes 1-2 minutes).
FLOOR = Config("transformers", "transformers generate, 1 at a time", ROOMY, ("multi_turn", "no_reuse"))


@dataclass(frozen=True)
class Session:
    """Requests sent in order, each once the previous one has finished. `chained`: request i's prompt is request
    i-1's prompt + its answer + `prompts[i]` (a conversation); otherwise each prompt is sent as it is. Request i is
    round `first_round + i`."""

    prompts: tuple[tuple[int, ...], ...]
    chained: bool = False
    first_round: int = 0

    def request_ids(self, history: tuple[int, ...], prompt: tuple[int, ...]) -> tuple[int, ...]:
        """The ids sent for `prompt`, given `history`: the previous request's ids and its answer."""
        return history + prompt if self.chained else prompt


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    concurrency: int  # sessions in flight in the closed loop
    repeats: int = 1  # runs per configuration, alternating the configurations' order


@dataclass(frozen=True)
class Record:
    """One request as the client saw it. Times in ms from sending the request; usage and prefetch wait as the
    router reported them on the last message."""

    session: int
    turn: int  # its round
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
    """The five workloads, the same for the same corpus, sizes and seed."""
    rng = random.Random(seed)
    return [multi_turn(corpus, sizes, rng), long_document(corpus, sizes, rng), shared_prefix(corpus, sizes, rng),
            no_reuse(corpus, sizes, rng), revisit(corpus, sizes, rng)]


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
    return Workload("no_reuse", tuple(Session((p,)) for p in prompts), concurrency=4,  # a batch, as in multi_turn
                    repeats=sizes.no_reuse_repeats)


def revisit(corpus: list[int], sizes: Sizes, rng: random.Random) -> Workload:
    documents = _slices(corpus, rng, sizes.revisit_documents, sizes.revisit_tokens)
    sessions = []
    for visit in range(sizes.revisit_passes):
        questions = _slices(corpus, rng, len(documents), sizes.question_tokens)
        order = rng.sample(range(len(documents)), len(documents))
        sessions += [Session((documents[d] + q,), first_round=visit) for d, q in zip(order, questions)]
    return Workload("revisit", tuple(sessions), concurrency=2)


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
    for turn, prompt in enumerate(session.prompts, start=session.first_round):
        ids = session.request_ids(history, prompt)
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


# -- the floor: plain transformers --------------------------------------------------------------------------------
class _FirstToken(BaseStreamer):
    """Notes when `generate` streams its first new token (its first `put` is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.at: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def floor(workloads: list[Workload], sizes: Sizes, dtype: str) -> dict[str, Load]:
    """Plain transformers `generate` on the same prompts in this process: no server, no reuse, one request at a time
    (the sessions of a workload one after another). The floor every configuration should beat."""
    device = engine_device()
    model = AutoModelForCausalLM.from_pretrained(resolve_model(""), dtype=getattr(torch, dtype)).to(device).eval()
    new = sizes.answer_tokens

    def generate(ids: tuple[int, ...], session: int, turn: int) -> tuple[Record, tuple[int, ...]]:
        first = _FirstToken()
        sent = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids], device=device), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, streamer=first)
        done = time.perf_counter()
        answer = tuple(out[0, len(ids):].tolist())
        return Record(session, turn, len(ids), len(answer), 0, 0, 0, 0, (first.at - sent) * 1e3,
                      (done - first.at) * 1e3 / (new - 1) if new > 1 else None, (done - sent) * 1e3, 0.0), answer

    generate(tuple(range(1000, 1064)), 0, 0)  # warm-up, off the clock
    loads = {}
    for workload in workloads:
        started, records = time.perf_counter(), []
        for index, session in enumerate(workload.sessions):
            history: tuple[int, ...] = ()
            for turn, prompt in enumerate(session.prompts, start=session.first_round):
                ids = session.request_ids(history, prompt)
                record, answer = generate(ids, index, turn)
                records.append(record)
                history = ids + answer
        loads[workload.name] = Load(tuple(records), time.perf_counter() - started)
        _progress(FLOOR, workload.name, loads[workload.name])
    return loads


# -- metrics -----------------------------------------------------------------------------------------------------
def metrics(load: Load) -> dict[str, tuple[float, str]]:
    """Summary of one load: name -> (value, unit). Hit ratios are cached over prompt tokens: all tiers, and L3."""
    ttft = [r.ttft_ms for r in load.records]
    itl = [r.itl_ms for r in load.records if r.itl_ms is not None]
    p50, p90, p99 = map(float, np.percentile(ttft, [50, 90, 99]))
    prompt_tokens = sum(r.prompt_tokens for r in load.records)
    return {
        "TTFT mean": (statistics.fmean(ttft), "ms"), "TTFT p50": (p50, "ms"), "TTFT p90": (p90, "ms"),
        "TTFT p99": (p99, "ms"), "inter-token latency mean": (statistics.fmean(itl) if itl else float("nan"), "ms"),
        "e2e p50": (float(np.percentile([r.e2e_ms for r in load.records], 50)), "ms"),
        "throughput": (len(load.records) / load.wall_s, "req/s"),
        "output throughput": (sum(r.completion_tokens for r in load.records) / load.wall_s, "tok/s"),
        "hit ratio": (sum(r.cached_tokens for r in load.records) / prompt_tokens, ""),
        "hit ratio from L3": (sum(r.cached_tokens_l3 for r in load.records) / prompt_tokens, ""),
        "prefetch wait mean": (statistics.fmean(r.prefetch_wait_ms for r in load.records), "ms"),
    }


def tier_tokens(load: Load) -> dict[str, int]:
    return {tier: sum(getattr(r, f"cached_tokens_{tier}") for r in load.records) for tier in ("l1", "l2", "l3")}


# The headline ratios, cache on over cache off; other rows are context.
GOALS = {("multi_turn", "round 5 TTFT mean"): "<= 0.20x (80% less)", ("multi_turn", "throughput"): ">= 2x",
         ("long_document", "TTFT mean"): "<= 0.39x (SGLang: -61%)",
         ("no_reuse", "TTFT mean"): "<= 1.03x (overhead)", ("no_reuse", "throughput"): ">= 0.97x (overhead)"}
SHOWN = {  # metrics in the table per comparison; every metric of every request is in the JSON
    "off": ("TTFT mean", "TTFT p50", "TTFT p90", "TTFT p99", "inter-token latency mean", "e2e p50", "throughput",
            "output throughput", "hit ratio", "prefetch wait mean"),
    "l2": ("TTFT mean", "TTFT p99", "throughput", "hit ratio", "hit ratio from L3", "prefetch wait mean"),
    FLOOR.name: ("TTFT mean", "TTFT p50", "output throughput"),
}


def rows(workload: str, name: str, ours: Load, baseline_name: str, baseline: Load) -> list[Row]:
    """`ours` (configuration `name`) against `baseline`: the metrics `SHOWN` for that baseline, then where requests
    have several rounds, the mean TTFT of each round."""
    summary, base = metrics(ours), metrics(baseline)
    headline = (name, baseline_name) == ("on", "off")
    label = f"{workload}: " if headline else f"{workload}, {name} vs {baseline_name}: "

    def row(metric: str, value: float, base_value: float, unit: str) -> Row:
        return Row(label + metric, value, base_value, unit, GOALS.get((workload, metric), "") if headline else "")

    out = [row(metric, summary[metric][0], base[metric][0], summary[metric][1]) for metric in SHOWN[baseline_name]]
    if baseline_name != FLOOR.name and any(r.turn for r in ours.records):
        by_round = zip(*(report.round_means([asdict(r) for r in load.records]) for load in (ours, baseline)))
        out += [row(f"round {t} TTFT mean", a, b, "ms") for t, (a, b) in enumerate(by_round, start=1)]
    return out


def table_rows(loads: dict[str, dict[str, Load]]) -> list[Row]:
    """Every configuration against its baseline, workload by workload; then cache on against the floor."""
    out = [row for config in CONFIGS if config.baseline for w in config.workloads
           for row in rows(w, config.name, loads[config.name][w], config.baseline, loads[config.baseline][w])]
    if FLOOR.name in loads:
        out += [row for w in FLOOR.workloads for row in rows(w, "on", loads["on"][w], FLOOR.name, loads[FLOOR.name][w])]
    return out


# -- the run -----------------------------------------------------------------------------------------------------
def run(out_prefix: Path, sizes: Sizes = Sizes(), dtype: str = "float32", rate: float | None = None,
        seed: int = 0) -> list[Row]:
    """Runs every configuration and the floor on the same workloads; writes every request to
    `<out_prefix>-workloads.json` and the plots to `<out_prefix>-workloads.png`. Process logs are kept on failure."""
    workloads = build(corpus_tokens(), sizes, seed)
    log_dir = Path(tempfile.mkdtemp(prefix="radixserve-bench-workloads-"))
    try:
        loads = measure_stack(log_dir, workloads, sizes, rate, seed, dtype=dtype)
    except BaseException as e:
        e.add_note(f"process logs: {log_dir}")
        raise
    shutil.rmtree(log_dir)
    loads[FLOOR.name] = floor([w for w in workloads if w.name in FLOOR.workloads], sizes, dtype)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    raw = {"sizes": asdict(sizes), "rate": rate, "seed": seed,
           "labels": {c.name: c.label for c in (*CONFIGS, FLOOR)},
           "configs": {c: {w: {"wall_s": load.wall_s, "tier_tokens": tier_tokens(load),
                               "records": [asdict(r) for r in load.records]} for w, load in by_workload.items()}
                       for c, by_workload in loads.items()}}
    Path(f"{out_prefix}-workloads.json").write_text(json.dumps(raw, indent=1))
    report.plot(raw, Path(f"{out_prefix}-workloads.png"))
    return table_rows(loads)


def measure_stack(log_dir: Path, workloads: list[Workload], sizes: Sizes, rate: float | None = None,
                  seed: int = 0, configs: tuple[Config, ...] = CONFIGS, dtype: str = "auto"
                  ) -> dict[str, dict[str, Load]]:
    """{config: {workload: load}}: every configuration's workloads through its router (see the module docstring),
    the configurations of a workload one after another; the workers run in `dtype`. Process logs go to `log_dir`."""
    services = LocalServices(log_dir)
    try:
        routers = _start(services, configs, dtype)
        return asyncio.run(_all(routers, configs, workloads, sizes, rate, seed))
    finally:
        services.stop()
        cleanup_stale_segments()  # only a daemon killed past its grace leaves one


def _start(services: LocalServices, configs: tuple[Config, ...], dtype: str) -> dict[str, str]:
    """One kvcached and one worker per distinct `Tiers`, one router per configuration; the routers' addresses."""
    stacks: dict[Tiers, tuple[str, str]] = {}
    routers = {}
    for config in configs:
        tiers = config.tiers
        if tiers not in stacks:
            i = len(stacks)
            disk = ["--disk-cache-size-gb", "2" if tiers.l3 else "0"]
            kvcached = services.kvcached(f"kvcached_{i}", ["--host-cache-size-gb", str(tiers.l2_gb), *disk])
            l1 = ["--l1-cache-size-gb", str(tiers.l1_gb), "--dtype", dtype]
            worker = services.worker(kvcached, f"worker_{i}", l1)
            stacks[tiers] = kvcached, worker
        kvcached, worker = stacks[tiers]
        routers[config.name] = services.router([worker], kvcached, f"router_{config.name}", list(config.router_args))
    return routers


async def _all(routers: dict[str, str], configs: tuple[Config, ...], workloads: list[Workload], sizes: Sizes,
               rate: float | None, seed: int) -> dict[str, dict[str, Load]]:
    sampling = router_pb2.SamplingParams(temperature=0, max_new_tokens=sizes.answer_tokens, ignore_eos=True)
    channels = {c: grpc.aio.insecure_channel(address) for c, address in routers.items()}
    try:
        stubs = {c: router_pb2_grpc.RouterStub(channel) for c, channel in channels.items()}
        warm_up = Workload("warm_up", (Session((tuple(range(1000, 1064)),)),), concurrency=1)
        for stub in stubs.values():  # first-request costs (lazy init, allocator) off the clock
            await drive(stub, warm_up, sampling, salt="warm_up")
        loads: dict[str, dict[str, Load]] = {c.name: {} for c in configs}
        for workload in workloads:
            runs = [c for c in configs if workload.name in c.workloads]
            for repeat in range(workload.repeats):
                for config in runs if repeat % 2 == 0 else reversed(runs):
                    salt = f"{workload.name}-{config.name}-{repeat}"  # configurations may share a stack
                    load = await drive(stubs[config.name], workload, sampling, salt, rate=rate, seed=seed)
                    _progress(config, workload.name, load)
                    loads[config.name][workload.name] = _merge(loads[config.name].get(workload.name), load)
        return loads
    finally:
        for channel in channels.values():
            await channel.close()


def _merge(earlier: Load | None, load: Load) -> Load:
    return load if earlier is None else Load(earlier.records + load.records, earlier.wall_s + load.wall_s)


def _progress(config: Config, workload: str, load: Load) -> None:
    print(f"{workload} [{config.label}]: {len(load.records)} requests in {load.wall_s:.1f} s, "
          f"TTFT mean {metrics(load)['TTFT mean'][0]:.0f} ms, cached tokens {tier_tokens(load)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, help="Poisson arrivals of sessions per second (default: closed loop)")
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    parser.add_argument("--full", action="store_true", help="the issue's workload sizes (`FULL`) instead of quick")
    args = parser.parse_args()
    out_prefix = RESULTS / time.strftime("%Y%m%d-%H%M%S")
    for row in run(out_prefix, FULL if args.full else Sizes(), resolved_dtype(), rate=args.rate, seed=args.seed):
        print(f"{row.name}: {row.ours:.3g} vs {row.baseline:.3g} {row.unit}  {row.goal}")
    print(f"records and plots: {out_prefix}-workloads.json, .png")


if __name__ == "__main__":
    main()
