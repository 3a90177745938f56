"""Prefix reuse in the worker: an L1 radix index over full pages of its own pool, fed from and to kvcached's L2,
and the partial last pages of finished sequences (tails), kept in L1 only.

    prompt pages:  | L1 hit (shared pages) | L2 hit (copied from shm) | tail hit (copied) | computed by prefill ... |
                   0                       n_l1                       n_l1 + n_l2

Reuse stops one token short of the prompt, so at least one prompt token is computed and yields the first logits.

Tails: a finished sequence's last page holds K/V for fewer tokens than a page (the index holds full pages only). It
is kept under the key of the full page before it (or the namespace's, with none) with the tokens it holds. The next
turn of a conversation (history, answer, new turn) continues that text: where its full-page match ends at such a
key, the kept tail sharing the most leading tokens with the prompt is copied into a new page of the sequence, and
those tokens count as cached (`cached_tokens_l1`). The copy, not a share, is what the sequence then writes into.
Without tails, a 4-conversation multi-turn round recomputed 44 tokens a request instead of 29 (its step 120 vs 83
ms here). Tails are evicted before index pages, least recently used key first: each is worth less than a page of
compute, and one whose full pages were evicted can no longer be reached. At most `MAX_TAILS_PER_KEY` per key (the
retries and branches of one turn); one that holds a prefix of another is dropped for it.

An L2 lease comes from the router and is trusted for nothing. Its pages are copied only from the segment this
worker registered, before the lease's expiry, from slots in range; and a copied page joins L1 only if the slot's
header had the lease's generation before and after the copy and names the key this worker computes from the prompt
and its own namespace (so neither an expired lease whose slot was reused nor another tenant's slot can pass). The
first page that fails ends the L2 prefix there: the rest is recomputed, counted in
`radixserve_worker_l2_pages_rejected_total{reason}`. The lease is released on every path (copied, unusable, the
request aborted or rejected).

Contracts (all calls under the engine lock, from the engine thread or `abort`):
- The index holds one pool reference on each cached page. A running sequence keeps a lease on its cached path, and
  so does each commit in flight to kvcached, so `index.evictable_pages` are pages only the index holds: evicting
  them frees them at once (`make_room`). Each kept tail holds the only reference on its page: all are evictable.
- `attach(seq)` on admission: fills the sequence's block table with reused pages and sets `num_computed`.
- `cache(seq)` when more full pages are computed (end of prefill): inserts them into the index and queues the ones
  kvcached lacks for commit. Idempotent.
- `finish(seq)` when the sequence ends, before its pages are released: `cache`, keeps its tail (one pool reference),
  and drops its lease and any unused L2 lease (`detach`).
- `fork(state)` for a sample forked from a sequence at the end of its prefill: a share of the parent's lease on the
  cached path (the sample holds those pages too), the same reuse counts, no L2 lease.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from model_worker import metrics
from model_worker.block_copy import HostBlockCopy
from model_worker.kv_pool import KVPool
from model_worker.kvcache_client import Attached, CommitJob, KVCacheClient
from radixserve.blocks.keys import BlockHash, block_hashes, namespace_key
from radixserve.blocks.radix import Lease, RadixIndex

LEASE_MARGIN_MS = 50  # a lease this close to its expiry is not used: copying a long prefix takes ~10 ms here
MAX_TAILS_PER_KEY = 4  # tails kept after one full page (module docstring)


@dataclass(frozen=True)
class L2Lease:
    """Raises ValueError unless there is one generation per slot."""

    lease_id: str
    segment_name: str
    slots: tuple[int, ...]  # kvcached slot of prompt page i
    generations: tuple[int, ...]  # of each slot when it was leased
    expires_unix_ms: int

    def __post_init__(self) -> None:
        if len(self.generations) != len(self.slots):
            raise ValueError(f"the L2 lease names {len(self.slots)} slots but {len(self.generations)} generations")


@dataclass(frozen=True)
class CacheRequest:
    """What a request may do with the cache: its tenant salt, whether reuse is on, its L2 lease if any."""

    salt: str = ""
    enabled: bool = True
    l2_lease: L2Lease | None = None
    trace: tuple[tuple[str, str], ...] = ()  # the request's trace context as metadata (radixserve.tracing), or none


@dataclass(eq=False)
class CacheState:
    """Per-sequence bookkeeping of the prefix cache."""

    request: CacheRequest
    l1_lease: Lease | None = None
    l2_lease_pending: bool = False  # the L2 lease still needs releasing (set from the request)
    cached_l1_tokens: int = 0
    cached_l2_tokens: int = 0
    pages_in_l1: int = 0  # leading pages of the sequence known to be in the L1 index
    pages_in_l2: int = 0  # leading pages known to be in kvcached
    l2_copy_ms: float = 0.0  # time the L2 -> L1 copy took at admission (reported in traces)

    def __post_init__(self) -> None:
        self.l2_lease_pending = self.request.l2_lease is not None


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
        # key of the full page before a tail -> {the tokens the tail holds: its page}, least recently used key first
        self._tails: OrderedDict[bytes, dict[tuple[int, ...], int]] = OrderedDict()
        self._tail_pages = 0

    @property
    def evictable_pages(self) -> int:
        return self._index.evictable_pages + self._tail_pages

    @property
    def cached_pages(self) -> int:
        return self._index.total_pages + self._tail_pages

    def make_room(self, pages: int) -> None:
        """Evicts tails, then least-recently-used unlocked index pages, until `pages` are free, or nothing more can
        go."""
        while self._tails and pages > self._pool.num_free:
            _, tails = self._tails.popitem(last=False)
            self._drop_tails(tails, list(tails))
        if pages > self._pool.num_free:
            self._pool.decref(self._index.evict(pages - self._pool.num_free))

    def _drop_tails(self, tails: dict[tuple[int, ...], int], held: list[tuple[int, ...]]) -> None:
        self._pool.decref([tails.pop(tokens) for tokens in held])
        self._tail_pages -= len(held)

    def _hashes(self, state: CacheState, token_ids: list[int]) -> list[BlockHash]:
        return block_hashes(namespace_key(self._fingerprint, state.request.salt), token_ids, self._page_size)

    def _reusable_hashes(self, state: CacheState, prompt: list[int]) -> list[BlockHash]:
        """The hashes of the prompt's full pages before its last token (which must be computed for its logits)."""
        usable = (len(prompt) - 1) // self._page_size
        return self._hashes(state, prompt[:usable * self._page_size])

    # -- admission ---------------------------------------------------------------------------------------------
    def cached_tokens(self, prompt: list[int], state: CacheState) -> int:
        """How much of `prompt` `attach` would find cached now, in tokens: the longer of its L1 match and its L2
        lease (a lease whose slots turn out unusable makes this an overestimate). Locks and copies nothing."""
        if not state.request.enabled:
            return 0
        hashes = self._reusable_hashes(state, prompt)
        lease = state.request.l2_lease
        leased = min(len(hashes), len(lease.slots)) if lease else 0
        pages = max(self._index.match(hashes).pages, leased)
        start = pages * self._page_size
        return start + self._tail_match(self._key_before(state, hashes, pages), prompt, start)[0]

    def attach(self, seq_id: Hashable, prompt: list[int], state: CacheState) -> int:
        """Puts the reusable prefix of `prompt` into the block table of `seq_id`; returns its length in tokens."""
        if not state.request.enabled:
            self._release_l2(state)
            return 0
        hashes = self._reusable_hashes(state, prompt)
        match = self._index.match(hashes, lock=True)
        state.l1_lease = match.lease
        l1_pages = list(match.slots)  # the L1 index's slots are pool pages
        self._pool.incref(l1_pages)
        table = self._pool.block_table(seq_id)
        table.extend(l1_pages)
        copy_started = time.perf_counter()
        l2_pages, lease_held = self._copy_from_l2(state, hashes, len(l1_pages))
        state.l2_copy_ms = (time.perf_counter() - copy_started) * 1e3
        self._release_l2(state)
        table.extend(l2_pages)
        state.pages_in_l1 = len(l1_pages)
        lease = state.request.l2_lease
        state.pages_in_l2 = len(lease.slots) if lease and lease_held else len(l1_pages) + len(l2_pages)
        tail_tokens = self._copy_tail(state, prompt, hashes, table)
        state.cached_l1_tokens = len(l1_pages) * self._page_size + tail_tokens
        state.cached_l2_tokens = len(l2_pages) * self._page_size
        return (len(l1_pages) + len(l2_pages)) * self._page_size + tail_tokens

    def _copy_from_l2(self, state: CacheState, hashes: list[BlockHash], first: int) -> tuple[list[int], bool]:
        """New L1 pages holding the leased L2 blocks [first, len(hashes)) that pass verification (module
        docstring), one contiguous copy per block; and whether every one passed."""
        lease = state.request.l2_lease
        if lease is None or self._client is None or first >= min(len(hashes), len(lease.slots)):
            return [], True
        slots, generations = lease.slots[first:len(hashes)], lease.generations[first:len(hashes)]
        attached = self._client.l2_segment(lease.segment_name)
        unusable = _unusable(lease, attached, slots)
        if unusable:
            metrics.l2_pages_rejected.labels(reason=unusable).inc(len(slots))
            return [], False
        self.make_room(len(slots))
        pages = self._pool.allocate(len(slots))
        kept, reason = copy_verified(self._block_copy, self._pool.kv, attached, pages, slots, generations,
                                     hashes[first:])
        if kept < len(slots):
            metrics.l2_pages_rejected.labels(reason=reason).inc(len(slots) - kept)
        self._pool.decref(pages[kept:])
        return pages[:kept], kept == len(slots)

    def _key_before(self, state: CacheState, hashes: list[BlockHash], pages: int) -> bytes:
        """The key tails after the first `pages` pages are kept under: the last page's, or the namespace's."""
        return hashes[pages - 1] if pages else namespace_key(self._fingerprint, state.request.salt)

    def _tail_match(self, key: bytes, prompt: list[int], start: int) -> tuple[int, int | None]:
        """The tail kept under `key` that shares the most leading tokens with `prompt[start:]`, short of its last
        token: (how many, its page), or (0, None)."""
        wanted = prompt[start:min(start + self._page_size, len(prompt) - 1)]
        return max(((_leading_shared(tokens, wanted), page) for tokens, page in self._tails.get(key, {}).items()),
                   key=lambda match: match[0], default=(0, None))

    def _copy_tail(self, state: CacheState, prompt: list[int], hashes: list[BlockHash], table: list[int]) -> int:
        """Appends a copy of the best kept tail after the table's pages to it (`_tail_match`); its tokens."""
        key = self._key_before(state, hashes, len(table))
        shared, source = self._tail_match(key, prompt, len(table) * self._page_size)
        if not shared:
            return 0
        self._tails.move_to_end(key)
        self._pool.incref([source])  # making room may evict this very tail
        self.make_room(1)
        page = self._pool.allocate(1)
        self._pool.kv[page[0]].copy_(self._pool.kv[source])
        self._pool.decref([source])
        table.extend(page)
        return shared

    def _release_l2(self, state: CacheState) -> None:
        if state.l2_lease_pending and self._client is not None:
            self._client.release(state.request.l2_lease.lease_id)
        state.l2_lease_pending = False

    # -- caching computed pages --------------------------------------------------------------------------------
    def cache(self, seq_id: Hashable, token_ids: list[int], num_computed: int, state: CacheState) -> None:
        """Inserts the sequence's computed full pages into the index and commits what kvcached lacks."""
        full = num_computed // self._page_size
        if state.request.enabled and full > state.pages_in_l1:
            self._insert(seq_id, token_ids, self._hashes(state, token_ids[:full * self._page_size]), state)

    def _insert(self, seq_id: Hashable, token_ids: list[int], hashes: list[BlockHash], state: CacheState) -> None:
        """`cache` with the hashes of the computed full pages, more than the sequence has cached."""
        full = len(hashes)
        table = self._pool.block_table(seq_id)[:full]
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
                                      l1_pages[first:], lambda: self._unlock_lease(lease), state.request.trace))

    def _unlock_lease(self, lease: Lease) -> None:
        with self._lock:
            self._index.unlock(lease)

    def fork(self, state: CacheState) -> CacheState:
        """The state of a sample forked from the sequence of `state` (module docstring)."""
        return CacheState(dataclasses.replace(state.request, l2_lease=None),
                          l1_lease=None if state.l1_lease is None else self._index.share(state.l1_lease),
                          cached_l1_tokens=state.cached_l1_tokens, cached_l2_tokens=state.cached_l2_tokens,
                          pages_in_l1=state.pages_in_l1, pages_in_l2=state.pages_in_l2)

    # -- end of a sequence -------------------------------------------------------------------------------------
    def finish(self, seq_id: Hashable, token_ids: list[int], num_computed: int, state: CacheState) -> None:
        """The sequence ended (module docstring); its pages are released next."""
        if state.request.enabled:
            full = num_computed // self._page_size
            end_of_full = full * self._page_size
            hashes = self._hashes(state, token_ids[:end_of_full])
            if full > state.pages_in_l1:
                self._insert(seq_id, token_ids, hashes, state)
            if num_computed > end_of_full:
                self._keep_tail(self._key_before(state, hashes, full), tuple(token_ids[end_of_full:num_computed]),
                                self._pool.block_table(seq_id)[full])
        self.detach(state)

    def _keep_tail(self, key: bytes, tokens: tuple[int, ...], page: int) -> None:
        """Keeps `page`, holding K/V for `tokens` after the full page of `key`, as a tail (module docstring)."""
        tails = self._tails.setdefault(key, {})
        self._tails.move_to_end(key)
        if any(kept[:len(tokens)] == tokens for kept in tails):  # an equal or longer one is kept
            return
        self._drop_tails(tails, [kept for kept in tails if tokens[:len(kept)] == kept])  # this one covers them
        if len(tails) >= MAX_TAILS_PER_KEY:
            self._drop_tails(tails, [next(iter(tails))])  # the oldest
        self._pool.incref([page])
        tails[tokens] = page
        self._tail_pages += 1

    def detach(self, state: CacheState) -> None:
        self._unlock(state)
        self._release_l2(state)

    def _unlock(self, state: CacheState) -> None:
        if state.l1_lease is not None:
            self._index.unlock(state.l1_lease)
            state.l1_lease = None

    def discard(self, state: CacheState) -> None:
        """For a request that never ran: releases its L2 lease."""
        self._release_l2(state)

    def check_integrity(self) -> None:
        self._index.check_integrity()
        self._pool.check_integrity()


def _leading_shared(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    shared = 0
    for x, y in zip(a, b):
        if x != y:
            break
        shared += 1
    return shared


def _unusable(lease: L2Lease, attached: Attached | None, slots: tuple[int, ...]) -> str:
    """Why no page of `lease` can be used at all ("" when they can be tried one by one)."""
    if time.time() * 1e3 > lease.expires_unix_ms - LEASE_MARGIN_MS:
        return "expired"
    if attached is None:
        return "segment"
    if max(slots) >= attached.segment.num_slots:
        return "out_of_range"
    return ""


def copy_verified(block_copy: HostBlockCopy, l1_kv: torch.Tensor, attached: Attached, pages: list[int],
                  slots: Sequence[int], generations: Sequence[int], keys: Sequence[BlockHash]) -> tuple[int, str]:
    """Copies `attached` slots into L1 `pages` up to the first slot whose header is not (its generation, its key);
    then drops the tail from the first slot whose generation changed during the copies (a seqlock). How many pages
    hold verified blocks, and why the next one failed ("" when none did)."""
    segment, kept, reason = attached.segment, 0, ""
    for page, slot, generation, key in zip(pages, slots, generations, keys):
        header = segment.header(slot)
        if header != (generation, key):
            reason = "generation" if header.generation != generation else "key"
            break
        block_copy.copy(l1_kv[page], attached.blocks[slot])
        kept += 1
    block_copy.drain()  # the copies are complete before the generations are read again
    for i in range(kept):
        if segment.generation(slots[i]) != generations[i]:
            return i, "generation"
    return kept, reason
