"""Prefix reuse in the worker: an L1 radix index over full pages of its own pool, fed from and to kvcached's L2.

    prompt pages:  | L1 hit (shared pages) | L2 hit (copied from shm) | computed by prefill ... | partial |
                   0                       n_l1                       n_l1 + n_l2                (never cached)

Reuse stops one token short of the prompt, so at least one prompt token is computed and yields the first logits.

Contracts (all calls under the engine lock, from the engine thread or `abort`):
- The index holds one pool reference on each cached page. A running sequence keeps a lease on its cached path, and
  so does each commit in flight to kvcached, so `index.evictable_pages` are pages only the index holds: evicting
  them frees them at once (`make_room`).
- `attach(seq)` on admission: fills the sequence's block table with reused pages and sets `num_computed`.
- `cache(seq)` whenever more full pages are computed (end of prefill, end of the request): inserts them into the
  index and queues the ones kvcached lacks for commit. Idempotent.
- `detach(seq)` when the sequence ends, before its pages are released: drops its lease and any unused L2 lease.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from model_worker.block_copy import HostBlockCopy
from model_worker.kv_pool import KVPool
from model_worker.kvcache_client import CommitJob, KVCacheClient
from radixserve.blocks.keys import BlockHash, block_hashes, namespace_key
from radixserve.blocks.radix import Lease, RadixIndex


@dataclass(frozen=True)
class L2Lease:
    lease_id: str
    segment_name: str
    slots: tuple[int, ...]  # kvcached slot of prompt page i


@dataclass(frozen=True)
class CacheRequest:
    """What a request may do with the cache: its tenant salt, whether reuse is on, its L2 lease if any."""

    salt: str = ""
    enabled: bool = True
    l2_lease: L2Lease | None = None


@dataclass(eq=False)
class CacheState:
    """Per-sequence bookkeeping of the prefix cache."""

    request: CacheRequest
    l1_lease: Lease | None = None
    l2_lease_pending: bool = False  # the L2 lease still needs releasing
    cached_l1_tokens: int = 0
    cached_l2_tokens: int = 0
    pages_in_l1: int = 0  # leading pages of the sequence known to be in the L1 index
    pages_in_l2: int = 0  # leading pages known to be in kvcached


class PrefixCache:
    def __init__(self, pool: KVPool, fingerprint: str, client: KVCacheClient | None, lock: threading.RLock,
                 block_copy: HostBlockCopy):
        """`lock` is the engine lock: commit completions arrive on the client thread and take it."""
        self._block_copy = block_copy
        self._pool = pool
        self._fingerprint = fingerprint
        self._client = client
        self._lock = lock
        self._index = RadixIndex()
        self._page_size = pool.page_size

    @property
    def evictable_pages(self) -> int:
        return self._index.evictable_pages

    @property
    def cached_pages(self) -> int:
        return self._index.total_pages

    def make_room(self, pages: int) -> None:
        """Evicts least-recently-used unlocked pages until `pages` are free, or nothing more can go."""
        shortfall = pages - self._pool.num_free
        if shortfall > 0:
            self._pool.decref(self._index.evict(shortfall))

    def _hashes(self, state: CacheState, token_ids: list[int]) -> list[BlockHash]:
        return block_hashes(namespace_key(self._fingerprint, state.request.salt), token_ids, self._page_size)

    # -- admission ---------------------------------------------------------------------------------------------
    def attach(self, request_id: str, prompt: list[int], state: CacheState) -> int:
        """Puts the reusable prefix of `prompt` into the block table of `request_id`; returns its length in tokens."""
        state.l2_lease_pending = state.request.l2_lease is not None
        if not state.request.enabled:
            self._release_l2(state)
            return 0
        usable = (len(prompt) - 1) // self._page_size
        match = self._index.match(self._hashes(state, prompt[:usable * self._page_size]), lock=True)
        state.l1_lease = match.lease
        l1_pages = list(match.slots)  # the L1 index's slots are pool pages
        self._pool.incref(l1_pages)
        table = self._pool.block_table(request_id)
        table.extend(l1_pages)
        l2_pages = self._copy_from_l2(state, len(l1_pages), usable)
        self._release_l2(state)
        table.extend(l2_pages)
        state.cached_l1_tokens = len(l1_pages) * self._page_size
        state.cached_l2_tokens = len(l2_pages) * self._page_size
        state.pages_in_l1 = len(l1_pages)
        state.pages_in_l2 = len(state.request.l2_lease.slots) if state.request.l2_lease else 0
        return len(table) * self._page_size

    def _copy_from_l2(self, state: CacheState, first: int, usable: int) -> list[int]:
        """New L1 pages holding the leased L2 blocks [first, usable), one contiguous copy per block."""
        lease = state.request.l2_lease
        if lease is None or self._client is None:
            return []
        blocks = self._client.l2_blocks(lease.segment_name)
        slots = lease.slots[first:usable]
        if blocks is None or not slots:
            return []
        self.make_room(len(slots))
        pages = self._pool.allocate(len(slots))
        for page, slot in zip(pages, slots):
            self._block_copy.copy(self._pool.kv[page], blocks[slot])
        self._block_copy.fence()
        return pages

    def _release_l2(self, state: CacheState) -> None:
        if state.l2_lease_pending and self._client is not None:
            self._client.release(state.request.l2_lease.lease_id)
        state.l2_lease_pending = False

    # -- caching computed pages --------------------------------------------------------------------------------
    def cache(self, request_id: str, token_ids: list[int], num_computed: int, state: CacheState) -> None:
        """Inserts the sequence's computed full pages into the index and commits what kvcached lacks."""
        full = num_computed // self._page_size
        if not state.request.enabled or full <= state.pages_in_l1:
            return
        hashes = self._hashes(state, token_ids[:full * self._page_size])
        table = self._pool.block_table(request_id)[:full]
        # The new lease pins the whole cached path, so eviction never takes pages this sequence still uses.
        inserted = self._index.insert(hashes, table, lock=True)
        new = inserted.cached_pages
        self._pool.incref(table[new:new + inserted.inserted_pages])
        self._unlock(state)
        state.l1_lease = inserted.lease
        state.pages_in_l1 = full
        self._commit(state, token_ids, inserted.slots)

    def _commit(self, state: CacheState, token_ids: list[int], l1_pages: tuple[int, ...]) -> None:
        full = len(l1_pages)
        if self._client is None or full <= state.pages_in_l2:
            return
        lease = self._index.share(state.l1_lease)  # pinned until the commit is done
        first = state.pages_in_l2
        state.pages_in_l2 = full
        self._client.commit(CommitJob(state.request.salt, tuple(token_ids[:full * self._page_size]), first,
                                      l1_pages[first:], lambda: self._unlock_lease(lease)))

    def _unlock_lease(self, lease: Lease) -> None:
        with self._lock:
            self._index.unlock(lease)

    # -- end of a sequence -------------------------------------------------------------------------------------
    def detach(self, state: CacheState) -> None:
        self._unlock(state)
        self._release_l2(state)

    def _unlock(self, state: CacheState) -> None:
        if state.l1_lease is not None:
            self._index.unlock(state.l1_lease)
            state.l1_lease = None

    def check_integrity(self) -> None:
        self._index.check_integrity()
        self._pool.check_integrity()
