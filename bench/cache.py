"""The KV cache, measured end to end and in its parts (issue: cache benchmark). Same run, same dtype throughout.

- ttft: time to first token of a ~2,000-token prompt whose first 1,900 tokens another worker computed (an L2 hit
  through kvcached's shared memory), against a fresh prompt with the radix cache off; an L1 hit for context.
  Through the real stack on loopback:

      router_a ──► worker_a ──┐
      router_b ──► worker_b ──┼──► kvcached (L2 in shared memory)
      router_off ─► worker_b  │    (--disable-radix-cache: cold)

- copy: the worker's L2→L1 loop (one memmove per block from the shared-memory slots into the page-first pool, two
  threads taking blocks in turn)
  against one `copy_` and one memmove of the same bytes, in process.
- match: kvcached's MatchPrefix over gRPC (4,096-token prompts, 100,000 blocks cached), synchronous client.
"""

from __future__ import annotations

import ctypes
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import torch

from bench import Row
from kvcached.tiers.dram_shm import SlabPool, cleanup_stale_segments
from model_worker.block_copy import block_copy_for, slab_blocks
from model_worker.kv_pool import KVPool
from model_worker.kvcache_client import Attached
from model_worker.prefix_cache import copy_verified
from radixserve.blocks.geometry import BlockGeometry
from radixserve.blocks.slab import SlabSegment, new_segment_name
from radixserve.launch import LocalServices
from radixserve.v1 import kvcache_pb2, kvcache_pb2_grpc, router_pb2, router_pb2_grpc

PAGE = 16
VOCAB = (100, 49_000)  # random prompt ids: clear of SmolLM2's special tokens


def smollm2_geometry(dtype: str) -> BlockGeometry:
    """SmolLM2-135M's KV geometry, so a block is the worker's real block (737,280 bytes in float32)."""
    return BlockGeometry(num_layers=30, num_kv_heads=3, head_dim=64, page_size=PAGE, dtype=dtype)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def _median_s(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up: page faults, allocator
    samples = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def run(dtype: str) -> list[Row]:
    log_dir = Path(tempfile.mkdtemp(prefix="radixserve-bench-"))
    try:
        rows = [*copy_bandwidth(dtype), *match_latency(log_dir), *ttft(log_dir)]
    except BaseException as e:
        e.add_note(f"process logs: {log_dir}")
        raise
    shutil.rmtree(log_dir)
    return rows


# -- 1. TTFT through the stack -----------------------------------------------------------------------------------
def _generate(router: str, token_ids: list[int]) -> router_pb2.GenerateResponse:
    request = router_pb2.GenerateRequest(token_ids=token_ids, sampling=router_pb2.SamplingParams(
        temperature=0, max_new_tokens=1, ignore_eos=True))
    with grpc.insecure_channel(router) as channel:
        *_, last = router_pb2_grpc.RouterStub(channel).Generate(request, timeout=600)
    return last


def model_fingerprint(router: str) -> str:
    with grpc.insecure_channel(router) as channel:
        models = router_pb2_grpc.RouterStub(channel).ListModels(router_pb2.ListModelsRequest(), timeout=10).models
    return models[0].fingerprint


def _wait_in_l2(kvcached: str, fingerprint: str, token_ids: list[int], timeout_s: float = 30) -> None:
    """Until kvcached holds every full page of `token_ids` (the worker commits off the request path)."""
    pages = len(token_ids) // PAGE
    request = kvcache_pb2.MatchPrefixRequest(model_fingerprint=fingerprint, token_ids=token_ids)
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(kvcached) as channel:
        stub = kvcache_pb2_grpc.KVCacheStub(channel)
        while (matched := stub.MatchPrefix(request, timeout=5).matched_pages) < pages:
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvcached holds {matched} of {pages} pages after {timeout_s:.0f} s")
            time.sleep(0.05)


def _check(what: str, ok: bool, response: router_pb2.GenerateResponse) -> None:
    if not ok:
        raise AssertionError(f"{what}: usage {response.usage}".replace("\n", " "))


def ttft(log_dir: Path, reps: int = 3, prompt_tokens: int = 2000, prefix_tokens: int = 1900) -> list[Row]:
    services = LocalServices(log_dir)
    try:
        kvcached = services.kvcached(args=["--host-cache-size-gb", "1"])
        worker_a, worker_b = services.worker(kvcached, "worker_a"), services.worker(kvcached, "worker_b")
        router_a = services.router([worker_a], kvcached, "router_a")
        router_b = services.router([worker_b], kvcached, "router_b")
        router_off = services.router([worker_b], kvcached, "router_off", ["--disable-radix-cache"])
        fingerprint = model_fingerprint(router_a)
        rng = random.Random(0)
        for router in (router_a, router_b, router_off):  # first-request costs (lazy init, allocator) off the clock
            _generate(router, _ids(rng, 64))
        prefix_pages = prefix_tokens // PAGE
        cold, l2, l1 = [], [], []
        for rep in range(reps):
            prompt = _ids(rng, prompt_tokens)
            _generate(router_a, prompt[:prefix_tokens])  # worker A computes the prefix and commits it to L2
            _wait_in_l2(kvcached, fingerprint, prompt[:prefix_pages * PAGE])
            hit = _generate(router_b, prompt)  # worker B has no L1 copy: an L2 hit
            _check("L2 hit", hit.usage.cached_tokens_l2 >= prefix_pages * PAGE, hit)
            again = _generate(router_b, prompt)  # now in B's L1
            _check("L1 hit", again.usage.cached_tokens_l1 >= prefix_pages * PAGE, again)
            fresh = _generate(router_off, _ids(rng, prompt_tokens))
            _check("cold", fresh.usage.cached_tokens == 0, fresh)
            cold.append(fresh.timings.ttft_ms)
            l2.append(hit.timings.ttft_ms)
            l1.append(again.timings.ttft_ms)
            print(f"ttft rep {rep}: cold {cold[-1]:.0f} ms (prefill {fresh.timings.prefill_ms:.0f}), L2 hit "
                  f"{l2[-1]:.0f} ms ({hit.usage.cached_tokens_l2} tokens, prefill {hit.timings.prefill_ms:.0f}), "
                  f"L1 hit {l1[-1]:.0f} ms ({again.usage.cached_tokens_l1} tokens, prefill "
                  f"{again.timings.prefill_ms:.0f})", flush=True)
    finally:
        services.stop()
        cleanup_stale_segments()  # only a daemon killed past its grace leaves one
    cold_ms = statistics.median(cold)
    return [
        Row(f"TTFT {prompt_tokens}-token prompt, {prefix_pages * PAGE} from L2 (other worker) vs cold, median of "
            f"{reps}", statistics.median(l2), cold_ms, "ms", "<= 0.10x cold"),
        Row(f"TTFT same prompt again, L1 hit vs cold, median of {reps}", statistics.median(l1), cold_ms, "ms",
            "(context)"),
    ]


# -- 2. L2→L1 copy bandwidth -------------------------------------------------------------------------------------
def copy_bandwidth(dtype: str, blocks: int = 120, pages: int = 128, reps: int = 15) -> list[Row]:
    geometry = smollm2_geometry(dtype)
    pool = KVPool(pages, geometry)
    block_bytes = geometry.block_bytes
    shm = SlabPool.create(new_segment_name(), block_bytes, blocks)
    attached = SlabSegment.attach(shm.name, block_bytes, blocks)
    try:
        slots = slab_blocks(shm.segment, geometry)
        slots.copy_(torch.randn(slots.shape))  # a sparse segment would read as the shared zero page
        rng = random.Random(0)
        pairs = list(zip(rng.sample(range(pages), blocks), rng.sample(range(blocks), blocks)))
        keys = [rng.randbytes(16) for _ in pairs]
        shm.allocate(blocks)
        for (_, slot), key in zip(pairs, keys):
            shm.set_key(slot, key)
        generations = [shm.generation(slot) for _, slot in pairs]
        worker_view = Attached(attached, slab_blocks(attached, geometry))

        block_copy = block_copy_for(pool.kv.device, waited_for=True)  # as the worker's L2 -> L1 copies

        def plain_loop() -> None:  # the copies alone, without the header checks
            for page, slot in pairs:
                block_copy.copy(pool.kv[page], slots[slot])
            block_copy.drain()  # they are made here

        def worker_loop() -> None:  # what PrefixCache._copy_from_l2 does: headers checked around each copy
            kept, _ = copy_verified(block_copy, pool.kv, worker_view, [p for p, _ in pairs], [s for _, s in pairs],
                                    generations, keys)
            if kept != blocks:
                raise AssertionError(f"only {kept} of {blocks} blocks verified")

        def torch_loop() -> None:  # torch's copy_ per block: runs on its intra-op thread pool
            for page, slot in pairs:
                pool.kv[page].copy_(slots[slot])

        dst = torch.zeros_like(slots)  # contiguous, touched
        total = blocks * block_bytes
        ours = total / _median_s(worker_loop, reps) / 1e9
        unverified = total / _median_s(plain_loop, reps) / 1e9
        memmove = total / _median_s(lambda: ctypes.memmove(dst.data_ptr(), slots.data_ptr(), total), reps) / 1e9
        torch_per_block = total / _median_s(torch_loop, reps) / 1e9
        del slots, dst, worker_loop, torch_loop, plain_loop, worker_view
    finally:
        attached.close()
        release(shm)
    what = f"L2->L1 copy, {blocks} blocks x {block_bytes:,} B ({dtype})"
    return [Row(f"{what}: the worker's copy per block vs one memmove of all of it", ours, memmove, "GB/s",
                ">= 0.5x"),
            Row(f"{what}: the worker's verified copy (slot headers checked) vs the same copies unverified", ours,
                unverified, "GB/s", ">= 0.95x"),
            Row(f"{what}: torch copy_ per block vs one memmove (the path the worker avoids: it stalls under load)",
                torch_per_block, memmove, "GB/s", "(diagnosis)")]


def release(shm: SlabPool) -> None:
    """Unlinks and closes a benchmark's pool, even while an exception's frame still holds a view of it."""
    shm.unlink()
    try:
        shm.close()
    except BufferError:  # a view still alive: the mapping goes with the process
        pass


# -- 3. MatchPrefix over gRPC ------------------------------------------------------------------------------------
def _fill(stub: kvcache_pb2_grpc.KVCacheStub, fingerprint: str, segment: str, rng: random.Random, blocks: int,
          prompt_pages: int, system_pages: int = 64, systems: int = 8) -> list[list[int]]:
    """Commits prompts of `prompt_pages` (one of `systems` shared prefixes + a unique rest) until `blocks` are
    cached; returns the prompts. Slots are allocated, never written: the index does not look at the bytes."""
    prefixes = [_ids(rng, system_pages * PAGE) for _ in range(systems)]
    cached_prefix = [False] * systems
    prompts, cached = [], 0
    while cached < blocks:
        which = rng.randrange(systems)
        prompt = prefixes[which] + _ids(rng, (prompt_pages - system_pages) * PAGE)
        first = system_pages if cached_prefix[which] else 0
        allocation = stub.AllocateSlots(kvcache_pb2.AllocateSlotsRequest(
            model_fingerprint=fingerprint, count=prompt_pages - first, segment_name=segment), timeout=10)
        if len(allocation.slots) != prompt_pages - first:
            raise RuntimeError(f"kvcached pool full after {cached} blocks")
        commit = stub.CommitBlocks(kvcache_pb2.CommitBlocksRequest(
            model_fingerprint=fingerprint, token_ids=prompt, first_page=first, slots=allocation.slots,
            allocation_id=allocation.allocation_id), timeout=10)
        cached += commit.inserted
        cached_prefix[which] = True
        prompts.append(prompt)
    return prompts


def match_latency(log_dir: Path, blocks: int = 100_000, prompt_tokens: int = 4096, calls: int = 1000) -> list[Row]:
    # 1 layer x 1 KV head x 8 dims x 16 tokens x K,V in float32: 1 KiB blocks, so 100k fit in 0.1 GiB.
    geometry = BlockGeometry(num_layers=1, num_kv_heads=1, head_dim=8, page_size=PAGE, dtype="float32",
                             layout="bench").to_pb()
    services = LocalServices(log_dir)
    try:
        # No disk tier: writing 100k blocks behind the fill would compete with the timed calls.
        address = services.kvcached("kvcached_match", ["--host-cache-size-gb", "0.1", "--disk-cache-size-gb", "0"])
        with grpc.insecure_channel(address) as channel:
            stub = kvcache_pb2_grpc.KVCacheStub(channel)
            segment = stub.RegisterNamespace(kvcache_pb2.RegisterNamespaceRequest(
                model_fingerprint="bench-match", geometry=geometry), timeout=10).segment_name
            rng = random.Random(0)
            prompts = _fill(stub, "bench-match", segment, rng, blocks, prompt_tokens // PAGE)
            (stats,) = stub.GetStats(kvcache_pb2.GetStatsRequest(), timeout=10).namespaces
            requests = [kvcache_pb2.MatchPrefixRequest(model_fingerprint="bench-match", token_ids=p)
                        for p in rng.sample(prompts, 50)]
            for request in requests:  # warm-up, and every query must hit all of its pages
                if stub.MatchPrefix(request, timeout=10).matched_pages != prompt_tokens // PAGE:
                    raise AssertionError("a committed prompt does not match in full")
            samples = _timed_ms(lambda i: stub.MatchPrefix(requests[i % len(requests)], timeout=10), calls)
            floor = _timed_ms(lambda i: stub.GetStats(kvcache_pb2.GetStatsRequest(), timeout=10), calls)
    finally:
        services.stop()
        cleanup_stale_segments()
    what = f"MatchPrefix over gRPC, {prompt_tokens} tokens, {stats.blocks_cached:,} blocks cached"
    floor_what = "vs GetStats round trip (gRPC floor)"
    return [Row(f"{what}, p50 {floor_what}", statistics.median(samples), statistics.median(floor), "ms", "<= 1 ms"),
            Row(f"{what}, p99 {floor_what}", _p99(samples), _p99(floor), "ms", "")]


def _timed_ms(call: Callable[[int], object], calls: int) -> list[float]:
    samples = []
    for i in range(calls):
        started = time.perf_counter()
        call(i)
        samples.append((time.perf_counter() - started) * 1e3)
    return samples


def _p99(samples: list[float]) -> float:
    return sorted(samples)[int(len(samples) * 0.99)]
