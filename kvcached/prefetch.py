"""Asynchronous L3 -> L2 prefetch: reads blocks from the disk tier into reserved shared-memory slots.

Each prefetch loads its pages front to back, `READ_BATCH` at a time and `READS_IN_FLIGHT` batches at once, on a
small thread pool, and caches them in order as soon as their bytes are in L2 (`KVCache.prefetched`), so a prefix of
the run is usable while the rest loads. Bookkeeping runs on the event loop; only the disk reads run on pool threads.

Faults end one prefetch, never the pool: a read that misses (absent, corrupt, I/O error) ends it at that page; a
batch that outlives `read_timeout_s` per page ends it too, and its slots are freed only when that batch finally
returns, because the stuck thread may still write into them.

When: only for an L3 run of at least `threshold_tokens` whose predicted load time (bytes / the measured read
bandwidth, a moving average) is below its predicted recompute time (tokens / `recompute_tokens_per_s`). The same
rule extends a cost-aware wait (the router's `timeout` policy) past its timeout: while the pages still loading are
predicted to arrive sooner than they would recompute, and keep arriving, waiting is the faster way to the first
token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvcached import metrics
from kvcached.cache import KVCache, Match, Prefetch
from kvcached.tiers.lmdb_tier import DiskTier

log = logging.getLogger("kvcached.prefetch")

INITIAL_READ_BPS = 1e9  # before the first measurement: a conservative guess for page-cache reads
EWMA_WEIGHT = 0.2
READ_BATCH = 8  # pages per pool-thread task: fewer event-loop round trips, yet a prefix is usable every 8 pages
READS_IN_FLIGHT = 2  # batches read at once: the copies release the GIL, so two threads read about 1.6x as fast
EXTEND_SLACK, EXTEND_MIN_S = 1.5, 0.01  # a cost-aware wait's next step: the predicted rest, with room for noise


class Prefetcher:
    def __init__(self, cache: KVCache, disk: DiskTier, threads: int, read_timeout_s: float, threshold_tokens: int,
                 page_size: int, recompute_tokens_per_s: float):
        self._cache = cache
        self._disk = disk
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="prefetch")
        self._read_timeout_s = read_timeout_s
        self._threshold_tokens = threshold_tokens
        self._page_size = page_size
        self._recompute_tps = recompute_tokens_per_s
        self._read_bps = INITIAL_READ_BPS
        self._finished: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task] = set()

    def worthwhile(self, pages: int, block_bytes: int) -> bool:
        tokens = pages * self._page_size
        return tokens >= self._threshold_tokens and pages * block_bytes / self._read_bps < tokens / self._recompute_tps

    def maybe_start(self, fingerprint: str, cache_salt: str, token_ids: Sequence[int], match: Match) -> str | None:
        """Starts (or joins) the prefetch of `match`'s L3 run when worthwhile; its id, or None."""
        block_bytes = self._cache.namespace(fingerprint).geometry.block_bytes
        if not match.l3_pages or not self.worthwhile(match.l3_pages, block_bytes):
            return None
        prefetch = self._cache.start_prefetch(fingerprint, cache_salt, token_ids, match)
        if prefetch is None:
            return None
        if prefetch.prefetch_id not in self._finished:
            self._finished[prefetch.prefetch_id] = asyncio.Event()
            task = asyncio.get_running_loop().create_task(self._run(prefetch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            metrics.prefetches.inc()
        return prefetch.prefetch_id

    async def wait(self, prefetch_id: str, timeout_s: float, cost_aware: bool = False) -> tuple[int, int, bool]:
        """(ready pages, total pages, done) after waiting up to `timeout_s` for the prefetch to finish; with
        `cost_aware`, then on while `_rest_if_cheaper` says waiting for the rest beats recomputing it."""
        prefetch = self._cache.prefetch(prefetch_id)
        if prefetch is None:  # finished before we looked, or never started
            return 0, 0, True
        finished, budget_s, extending = self._finished[prefetch_id], timeout_s, False
        started, ready_at_start = time.monotonic(), prefetch.ready
        while True:
            ready = prefetch.ready
            try:
                await asyncio.wait_for(finished.wait(), budget_s)
                break
            except TimeoutError:
                pass
            if not cost_aware or (extending and prefetch.ready == ready):  # an extension that brought nothing: stuck
                break
            loaded = prefetch.ready - ready_at_start
            page_s = ((time.monotonic() - started) / loaded if loaded
                      else prefetch.namespace.geometry.block_bytes / self._read_bps)
            budget_s, extending = self._rest_if_cheaper(prefetch, page_s), True
            if budget_s is None:
                break
        return prefetch.ready, prefetch.total, prefetch.done

    def _rest_if_cheaper(self, prefetch: Prefetch, page_s: float) -> float | None:
        """How much longer to wait for `prefetch`'s remaining pages, loading at `page_s` a page (as fast as during
        this wait, else the disk's measured bandwidth): their predicted load time with some slack, if it is below
        their predicted recompute time; else None (stop waiting)."""
        remaining = prefetch.total - prefetch.ready
        load_s = remaining * page_s
        recompute_s = remaining * self._page_size / self._recompute_tps
        return EXTEND_SLACK * load_s + EXTEND_MIN_S if load_s < recompute_s else None

    async def _run(self, prefetch: Prefetch) -> None:
        stuck: list[int] = []
        in_flight: deque[asyncio.Task] = deque()
        try:
            sent, last = prefetch.ready, time.perf_counter()
            while prefetch.ready < prefetch.total:
                while len(in_flight) < READS_IN_FLIGHT and sent < prefetch.total:
                    batch = prefetch.slots[sent:sent + READ_BATCH]
                    in_flight.append(asyncio.ensure_future(self._read(prefetch, sent, batch, stuck)))
                    sent += len(batch)
                batch_size = min(READ_BATCH, prefetch.total - prefetch.ready)
                loaded = await in_flight.popleft()
                last = self._measure(loaded * prefetch.namespace.geometry.block_bytes, last)
                if not all(self._cache.prefetched(prefetch) for _ in range(loaded)) or loaded < batch_size:
                    break
        except Exception:  # a task's exception would otherwise vanish with it; the prefetch ends here
            log.exception("prefetch failed; ending it", extra={"prefetch_id": prefetch.prefetch_id})
            metrics.prefetch_failures.labels(reason="error").inc()
        finally:
            # reads still in flight end first (a stuck one adds its slots to `stuck`): nothing writes a freed slot
            await asyncio.gather(*in_flight, return_exceptions=True)
            metrics.prefetched_blocks.inc(prefetch.ready)
            self._cache.end_prefetch(prefetch, keep=stuck)
            self._finished.pop(prefetch.prefetch_id).set()

    def _measure(self, nbytes: int, since: float) -> float:
        """Folds `nbytes` read since `since` (the previous batch's arrival: batches arrive in order, so this is the
        pace of the reads in flight together) into the read bandwidth; returns now."""
        now = time.perf_counter()
        if nbytes:
            self._read_bps += EWMA_WEIGHT * (nbytes / max(now - since, 1e-6) - self._read_bps)
        return now

    async def _read(self, prefetch: Prefetch, index: int, slots: list[int], stuck: list[int]) -> int:
        """Reads pages [index, index + len(slots)) of the prefetch into `slots` on a pool thread; how many, from
        the front, arrived."""
        first = prefetch.first + index
        hashes = prefetch.hashes[first:first + len(slots)]
        views = [prefetch.namespace.pool.view(slot) for slot in slots]
        future = self._executor.submit(self._read_run, hashes, views)
        try:
            loaded = await asyncio.wait_for(asyncio.wrap_future(future), self._read_timeout_s * len(slots))
        except TimeoutError:
            log.warning("prefetch read timed out; ending this prefetch", extra={"timeout_s": self._read_timeout_s})
            metrics.prefetch_failures.labels(reason="timeout").inc()
            stuck.extend(slots)  # the stuck thread may still write any of them
            loop = asyncio.get_running_loop()
            future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._free_stuck, prefetch, slots))
            return 0
        if loaded < len(slots):
            metrics.prefetch_failures.labels(reason="miss").inc()
        return loaded

    def _read_run(self, hashes, views) -> int:
        """On a pool thread: reads blocks in order until the first miss; how many were read."""
        for loaded, (block_hash, view) in enumerate(zip(hashes, views)):
            if not self._disk.read_into(block_hash, view):
                return loaded
        return len(views)

    def _free_stuck(self, prefetch: Prefetch, slots: list[int]) -> None:
        for slot in slots:
            self._cache.free_slot(prefetch.namespace, slot)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
