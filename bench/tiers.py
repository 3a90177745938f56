"""The disk tier (L3), measured end to end and in its parts (issue: tiers benchmark). Same run, same dtype throughout.

- ttft: time to first token of a ~2,000-token prompt whose first 1,900 tokens exist only in L3 (worker A computed
  them, kvcached flushed them to disk and restarted, worker B never saw them; the default policy, `timeout` at its
  default 200 ms, cost-aware; the run fails unless the whole prefix comes from L3), against
  a fresh prompt with the radix cache off. Through the real stack on loopback:

      router_warm ───────► worker_a ──┐
      router_<policy> ───► worker_b ──┼──► kvcached (L2 in shared memory, L3 in LMDB; restarted: L2 empty)
      router_off ────────► worker_b   │    (--disable-radix-cache: cold)

- prefetch: the prefetch path (`DiskTier.read_into` per block into a `SlabPool` slot, as kvcached/prefetch.py does)
  against one sequential read of data.mdb and against raw `txn.get` + copy without the checksum, in process.
- mixed: a closed loop (4 in flight) of prompts whose prefix is only in L3 and fresh prompts, under each prefetch
  policy, with kvcached's `--l3-read-delay-ms` emulating a slow disk. The L3 prefixes are committed straight to
  kvcached (AllocateSlots + CommitBlocks) instead of computed by a worker: TTFT does not depend on the KV values, and
  computing 24 prefixes would take minutes here. Each policy gets its own prefixes, all flushed to L3 before one
  restart, so each policy finds its prefixes in L3 only (the same as a restart per policy, without its cost).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import lmdb

from bench import Row
from bench.cache import (PAGE, _check, _generate, _ids, _median_s, _p99, model_fingerprint, release,
                         smollm2_geometry)
from kvcached.tiers.dram_shm import SlabPool, cleanup_stale_segments
from kvcached.tiers.lmdb_tier import ROOT_PARENT, DiskTier
from radixserve.blocks.slab import new_segment_name
from radixserve.launch import LocalServices
from radixserve.v1 import kvcache_pb2, kvcache_pb2_grpc, router_pb2, router_pb2_grpc

POLICIES = ("wait_complete", "timeout", "best_effort")
# Room for every block of the run in both tiers, so neither evicts a prefix the run still needs.
KVCACHED_ARGS = ["--host-cache-size-gb", "1.5", "--disk-cache-size-gb", "3"]
READ_DELAY_MS = 20  # per L3 block in the mixed run: a 38-page prefix loads in ~0.4 s (two batches of 8 at once),
#                     twice the timeout policy's wait


def run(dtype: str) -> list[Row]:
    log_dir = Path(tempfile.mkdtemp(prefix="radixserve-bench-tiers-"))
    try:
        rows = [*prefetch_bandwidth(dtype, log_dir), *through_the_stack(log_dir)]
    except BaseException as e:
        e.add_note(f"process logs: {log_dir}")
        raise
    shutil.rmtree(log_dir)
    return rows


# -- 1. L3 -> L2 prefetch bandwidth ------------------------------------------------------------------------------
def prefetch_bandwidth(dtype: str, log_dir: Path, blocks: int = 120, reps: int = 7) -> list[Row]:
    block_bytes = smollm2_geometry(dtype).block_bytes
    total = blocks * block_bytes
    path = log_dir / "bench-l3"
    rng = random.Random(0)
    keys = [rng.randbytes(16) for _ in range(blocks)]  # prompt order; LMDB stores them in key (random) order
    shm = SlabPool.create(new_segment_name(), block_bytes, blocks)
    try:
        views = [shm.view(slot) for slot in range(blocks)]
        with DiskTier(path, 4 * total) as disk:
            for key in keys:
                disk.put_async("bench", key, ROOT_PARENT, rng.randbytes(block_bytes))
            disk.flush()

            def prefetch_loop() -> None:  # what Prefetcher._read does for each page of a prefetch, in turn
                for key, view in zip(keys, views):
                    if not disk.read_into(key, view):
                        raise AssertionError("a stored block missed")

            ours = total / _median_s(prefetch_loop, reps) / 1e9
        # NOTE: LMDB forbids opening one environment twice in a process: the tier is closed before this.
        with lmdb.open(str(path), readonly=True, lock=False) as env:
            def raw_loop() -> None:
                for key, view in zip(keys, views):
                    with env.begin(buffers=True) as txn:
                        value = txn.get(key)
                        view[:] = value[len(value) - block_bytes:]

            raw = total / _median_s(raw_loop, reps) / 1e9
        out = shm.segment.buffer[:total]
        with open(path / "data.mdb", "rb", buffering=0) as f:
            def file_read() -> None:
                f.seek(0)
                if f.readinto(out) != total:
                    raise AssertionError("data.mdb is shorter than the blocks it holds")

            sequential = total / _median_s(file_read, reps) / 1e9
        del views, out
    finally:
        release(shm)
    what = f"L3->L2, {blocks} blocks x {block_bytes:,} B ({dtype}), page cache warm (nothing dropped)"
    prefetch = "prefetch path (DiskTier.read_into per block, checksum verified, into SlabPool slots)"
    return [Row(f"{what}: {prefetch} vs one sequential read of data.mdb", ours, sequential, "GB/s", ">= 0.7x"),
            Row(f"{what}: {prefetch} vs raw txn.get + copy per block, no checksum", ours, raw, "GB/s",
                "(diagnosis)")]


# -- 2 and 3. through the stack ----------------------------------------------------------------------------------
def through_the_stack(log_dir: Path) -> list[Row]:
    services = LocalServices(log_dir)
    try:
        kvcached = services.kvcached(args=KVCACHED_ARGS)
        workers = [services.worker(kvcached, "worker_a"), services.worker(kvcached, "worker_b")]
        routers = {"warm": services.router(workers[:1], kvcached, "router_warm"),
                   "off": services.router(workers[1:], kvcached, "router_off", ["--disable-radix-cache"])}
        for policy in POLICIES:
            routers[policy] = services.router(workers[1:], kvcached, f"router_{policy}",
                                               ["--prefetch-policy", policy, "--prefetch-timeout-ms", "200"])
        fingerprint = model_fingerprint(routers["warm"])
        rng = random.Random(0)
        for router in routers.values():  # first-request costs (lazy init, allocator) off the clock
            _generate(router, _ids(rng, 64))
        rows = ttft(services, kvcached, workers, routers, rng)
        rows += mixed(services, kvcached, workers, fingerprint, routers, rng)
    finally:
        services.stop()
        cleanup_stale_segments()  # only a daemon killed past its grace leaves one
    return rows


def _stats(kvcached: str) -> kvcache_pb2.KVCacheStats:
    with grpc.insecure_channel(kvcached) as channel:
        return kvcache_pb2_grpc.KVCacheStub(channel).GetStats(kvcache_pb2.GetStatsRequest(), timeout=5)


def _wait(what: str, condition, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(0.1)


def _into_l3(kvcached: str, cache: Callable[[], int]) -> None:
    """Runs `cache()`, which caches a prefix's blocks and returns how many, and waits until L3 holds them. One prefix
    at a time: the writer stores them on idle cores, and with the L3 write queue at 256 MB then, three prefixes of
    1,888 tokens queued at once (261 MB) lost blocks that way: those never reach the disk."""
    on_disk = _stats(kvcached).disk.blocks
    blocks = cache()
    _wait("prefix in L3", lambda: _stats(kvcached).disk.blocks >= on_disk + blocks)


def _restart(services: LocalServices, workers: list[str], args: list[str] = ()) -> None:
    """SIGTERM kvcached (it flushes L3), start a new one on the same port and disk (its L2 starts empty), then wait
    for the workers' heartbeat to re-register their namespace. As tests/test_e2e_l3.py does."""
    code = services.stop_service("kvcached")
    if code != 0:
        raise RuntimeError(f"kvcached exited with {code} on SIGTERM")
    services.start_again("kvcached", args)
    if not services.workers_registered(workers, timeout_s=60):
        raise TimeoutError("the workers did not re-register with the restarted kvcached")


def ttft(services: LocalServices, kvcached: str, workers: list[str], routers: dict[str, str], rng: random.Random,
         reps: int = 3, prompt_tokens: int = 2000, prefix_tokens: int = 1900) -> list[Row]:
    prefix_pages = prefix_tokens // PAGE
    prompts = [_ids(rng, prompt_tokens) for _ in range(reps)]
    def compute(prompt: list[int]) -> int:  # worker A; write_through queues its blocks for L3 at once
        _generate(routers["warm"], prompt[:prefix_tokens])
        return prefix_pages

    for prompt in prompts:
        _into_l3(kvcached, lambda: compute(prompt))
    _restart(services, workers)
    cold, l3, parts = [], [], []
    for rep, prompt in enumerate(prompts):
        hit = _generate(routers["timeout"], prompt)  # worker B, L2 empty: every prefix page comes from L3
        _check("L3 hit", hit.usage.cached_tokens_l3 >= prefix_pages * PAGE, hit)
        fresh = _generate(routers["off"], _ids(rng, prompt_tokens))
        _check("cold", fresh.usage.cached_tokens == 0, fresh)
        cold.append(fresh.timings.ttft_ms)
        l3.append(hit.timings.ttft_ms)
        parts.append(_ttft_parts(hit.timings))
        print(f"tiers ttft rep {rep}: cold {cold[-1]:.0f} ms (prefill {fresh.timings.prefill_ms:.0f}), L3 hit "
              f"{l3[-1]:.0f} ms ({hit.usage.cached_tokens_l3} tokens from L3, "
              + ", ".join(f"{part} {ms:.0f}" for part, ms in parts[-1].items()) + ")", flush=True)
    what = f"TTFT {prompt_tokens}-token prompt, {prefix_pages * PAGE} only in L3 (kvcached restarted, other worker, " \
           f"default policy)"
    return [Row(f"{what} vs cold, median of {reps}", statistics.median(l3), statistics.median(cold), "ms",
                "<= 0.10x cold"),
            Row(f"{what}: the worst rep's hit / cold", max(h / c for h, c in zip(l3, cold)), None, "x",
                "<= 0.10 in every run"),
            *(Row(f"{what}: {part} of it, median of {reps}", statistics.median(one[part] for one in parts), None,
                  "ms", "(context)") for part in parts[0])]


def _ttft_parts(timings: router_pb2.Timings) -> dict[str, float]:
    """A hit's time to first token in its parts (ms): the router's prefetch wait; the worker's queue (admission and
    the L2 -> L1 copy); its prefill (the forward); and the rest (the router's work, its calls to kvcached and to
    the worker, the first token's way back)."""
    rest = timings.ttft_ms - timings.prefetch_wait_ms - timings.queue_ms - timings.prefill_ms
    return {"prefetch wait": timings.prefetch_wait_ms, "worker queue (admission, L2->L1 copy)": timings.queue_ms,
            "prefill": timings.prefill_ms, "the rest (router, RPCs)": rest}


def _commit(stub: kvcache_pb2_grpc.KVCacheStub, fingerprint: str, token_ids: list[int]) -> int:
    """Caches the full pages of `token_ids` in kvcached as a worker would, without computing them; returns how many."""
    pages = len(token_ids) // PAGE
    (segment,) = [ns.segment_name for ns in stub.GetStats(kvcache_pb2.GetStatsRequest(), timeout=10).namespaces
                  if ns.model_fingerprint == fingerprint]
    allocation = stub.AllocateSlots(kvcache_pb2.AllocateSlotsRequest(
        model_fingerprint=fingerprint, count=pages, segment_name=segment), timeout=10)
    if len(allocation.slots) != pages:
        raise RuntimeError(f"kvcached's L2 pool gave {len(allocation.slots)} of {pages} slots")
    return stub.CommitBlocks(kvcache_pb2.CommitBlocksRequest(
        model_fingerprint=fingerprint, token_ids=token_ids, first_page=0, slots=allocation.slots,
        allocation_id=allocation.allocation_id), timeout=10).inserted


async def _closed_loop(router: str, prompts: list[tuple[str, list[int]]], concurrency: int, max_new_tokens: int
                       ) -> tuple[list[tuple[str, router_pb2.GenerateResponse]], float]:
    """Sends every prompt with `concurrency` in flight; (kind, final response) per prompt and the wall time."""
    queue = iter(prompts)
    done: list[tuple[str, router_pb2.GenerateResponse]] = []
    sampling = router_pb2.SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
    async with grpc.aio.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def client() -> None:
            for kind, token_ids in queue:
                call = stub.Generate(router_pb2.GenerateRequest(token_ids=token_ids, sampling=sampling), timeout=600)
                async for last in call:
                    pass
                done.append((kind, last))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
    return done, time.perf_counter() - started


def mixed(services: LocalServices, kvcached: str, workers: list[str], fingerprint: str,
          routers: dict[str, str], rng: random.Random, requests: int = 16, concurrency: int = 4, prefix_tokens: int = 608, suffix_tokens: int = 32,
          fresh_tokens: int = 256, max_new_tokens: int = 8) -> list[Row]:
    prefixes = {policy: [_ids(rng, prefix_tokens) for _ in range(requests // 2)] for policy in POLICIES}
    with grpc.insecure_channel(kvcached) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        for prefix in (p for ps in prefixes.values() for p in ps):
            _into_l3(kvcached, lambda: _commit(stub, fingerprint, prefix))
    _restart(services, workers, ["--l3-read-delay-ms", str(READ_DELAY_MS)])
    rows, baseline = [], {}
    for policy in POLICIES:
        prompts = []
        for prefix in prefixes[policy]:  # alternating: an L3 prompt, a fresh one
            prompts += [("l3", prefix + _ids(rng, suffix_tokens)), ("fresh", _ids(rng, fresh_tokens))]
        done, wall_s = asyncio.run(_closed_loop(routers[policy], prompts, concurrency, max_new_tokens))
        ttfts = {kind: [r.timings.ttft_ms for k, r in done if k == kind] for kind in ("l3", "fresh")}
        from_l3 = [r.usage.cached_tokens_l3 for k, r in done if k == "l3"]
        if policy == "wait_complete" and min(from_l3) < prefix_tokens:
            raise AssertionError(f"wait_complete served only {min(from_l3)} of {prefix_tokens} prefix tokens from L3")
        waits = [r.timings.prefetch_wait_ms for k, r in done if k == "l3"]
        print(f"tiers mixed {policy}: {wall_s:.1f} s, L3 prompts: mean {statistics.mean(from_l3):.0f} tokens from L3, "
              f"mean prefetch wait {statistics.mean(waits):.0f} ms; TTFT ms l3 {sorted(ttfts['l3'])}, "
              f"fresh {sorted(ttfts['fresh'])}", flush=True)
        p99 = f"P99 (of {requests // 2}: the max)" if requests // 2 < 100 else "P99"
        results = {("fresh", p99): _p99(ttfts["fresh"]), ("fresh", "mean"): statistics.mean(ttfts["fresh"]),
                   ("l3", p99): _p99(ttfts["l3"]), ("l3", "mean"): statistics.mean(ttfts["l3"]),
                   ("throughput", ""): len(done) / wall_s}
        baseline = baseline or results
        what = (f"mixed, {concurrency} in flight, {requests // 2} L3-prefix ({prefix_tokens}+{suffix_tokens}) + "
                f"{requests // 2} fresh ({fresh_tokens}) prompts, L3 read delay {READ_DELAY_MS} ms/block, {policy}")
        versus = "" if policy == "wait_complete" else " vs wait_complete"
        for (kind, stat), value in results.items():
            goal = "< 1x" if (kind, stat) == ("fresh", p99) and versus else ""
            name = {"fresh": f"TTFT {stat} of fresh prompts", "l3": f"TTFT {stat} of L3-prefix prompts",
                    "throughput": "throughput"}[kind]
            rows.append(Row(f"{what}: {name}{versus}", value, baseline[kind, stat] if versus else None,
                            "req/s" if kind == "throughput" else "ms", goal))
    return rows
