"""The daemon's core: per-model namespaces (an L2 slab pool and its radix index), leases and allocations.

No gRPC here; `kvcached.service` translates. Not thread-safe: the service calls it from its event loop only.

Life of a block:
    AllocateSlots ─► worker writes the block's bytes into the slot ─► CommitBlocks ─► cached in the index
       (new generation, no key)                                        (the slot's header gets the block key)
                                          (an allocation not committed before its TTL returns to the pool)
    MatchPrefix(lease) ─► worker copies the slots into its L1 ─► ReleaseLease (or the lease's TTL passes)
       (slots, their generations, the lease's expiry: the worker verifies each page against its header)

Contracts
- A leased slot is neither evicted nor reused until its lease is released or expires. A lease may expire while a
  worker still holds it: then the slot's generation changes before anyone else writes it, which the worker sees.
- An allocated slot belongs to its allocation until CommitBlocks or expiry; commits may only name its slots. An
  allocation is bound to the segment its caller names, which must be the namespace's: a worker attached to the
  segment of a kvcached that has since restarted cannot commit bytes it wrote elsewhere.
- A slot's header key is set only for a page inserted into the index, after its bytes are in place.
- TTLs above `max_ttl_s` and allocations above `max_allocation_slots` are refused (InvalidRequest).
- `check_integrity()`: per namespace, free + allocated + cached slots = total, and the index is consistent.
- Errors: `NotFound` (unknown namespace, lease or allocation, e.g. expired), `InvalidRequest` (the request is
  wrong in itself), `Conflict` (disagrees with the registered namespace), `Exhausted` (no shared memory for a new
  pool). The cache is unchanged after any of them.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvcached.l3 import L3
from kvcached.tiers.dram_shm import SlabPool
from radixserve.blocks.geometry import BlockGeometry
from radixserve.blocks.keys import BlockHash, block_hashes, namespace_key
from radixserve.blocks.radix import Lease, RadixIndex
from radixserve.blocks.slab import new_segment_name

log = logging.getLogger("kvcached.cache")

MAX_FINGERPRINT_BYTES = 256  # a model fingerprint is a SHA-256 hex digest (64); L3 headers hold at most 65,535


class NotFound(KeyError):
    pass


class InvalidRequest(ValueError):
    pass


class Conflict(ValueError):
    pass


class Exhausted(RuntimeError):
    pass


class Match(NamedTuple):
    pages: int  # the L2 prefix
    l2_slots: tuple[int, ...]
    lease_id: str | None  # None without a lease or without a match
    l3_pages: int = 0  # pages after the L2 prefix that L3 holds, consecutively
    generations: tuple[int, ...] = ()  # of each slot in `l2_slots`, now
    lease_expires_unix_s: float = 0.0  # wall clock; 0 without a lease


class Allocation(NamedTuple):
    allocation_id: str
    slots: tuple[int, ...]
    evicted: int  # cached pages evicted to make room


class Commit(NamedTuple):
    inserted: int
    already_cached: int


@dataclass
class _Held:
    """A lease or an allocation: what it holds and when it expires."""

    namespace: Namespace
    expires_at: float
    lease: Lease | None = None
    slots: frozenset[int] = frozenset()


@dataclass
class Namespace:
    fingerprint: str
    geometry: BlockGeometry
    pool: SlabPool
    index: RadixIndex = field(default_factory=RadixIndex)
    allocated: set[int] = field(default_factory=set)  # slots of allocations and prefetches, and `stuck` ones
    stuck: set[int] = field(default_factory=set)  # slots of ended prefetches whose disk read is still running


@dataclass(eq=False)
class Prefetch:
    """Loading pages [first, first + len(slots)) of a prompt from L3 into reserved L2 slots, front to back.

    While it runs, its lease pins the prompt's L2 prefix, so each loaded page extends a cached chain. Its slots
    count as allocated until `KVCache.prefetched` inserts them or `KVCache.end_prefetch` frees them.
    """

    prefetch_id: str
    namespace: Namespace
    hashes: list[BlockHash]
    first: int
    slots: list[int]
    lease: Lease
    ready: int = 0  # pages loaded and inserted so far
    done: bool = False

    @property
    def total(self) -> int:
        return len(self.slots)


class KVCache:
    """See the module docstring. `clock` is injectable so that tests can expire leases without sleeping."""

    def __init__(self, host_cache_bytes: int, page_size: int, lease_ttl_s: float,
                 clock: Callable[[], float] = time.monotonic, l3: L3 | None = None, max_ttl_s: float = 300.0,
                 max_allocation_slots: int = 1024):
        """`l3` None: no disk tier. A lease's wall-clock expiry is `time.time()` + its TTL; `clock` drives expiry."""
        self.l3 = l3
        self._max_ttl_s = max_ttl_s
        self._max_allocation_slots = max_allocation_slots
        self._prefetches: dict[str, Prefetch] = {}
        self._pool_bytes = host_cache_bytes
        self._page_size = page_size
        self._ttl = lease_ttl_s
        self._clock = clock
        self._namespaces: dict[str, Namespace] = {}
        self._held: dict[str, _Held] = {}
        self._ids = itertools.count(1)

    # -- namespaces --------------------------------------------------------------------------------------------
    def register(self, fingerprint: str, geometry: BlockGeometry) -> Namespace:
        """The namespace of `fingerprint`, creating its pool on first registration."""
        if not 0 < len(fingerprint.encode()) <= MAX_FINGERPRINT_BYTES:
            raise InvalidRequest(f"model_fingerprint must be 1-{MAX_FINGERPRINT_BYTES} bytes (a digest), "
                                 f"got {len(fingerprint.encode())}")
        if geometry.page_size != self._page_size:
            raise Conflict(f"geometry.page_size {geometry.page_size} != kvcached --page-size {self._page_size}")
        existing = self._namespaces.get(fingerprint)
        if existing is not None:
            if existing.geometry != geometry:
                raise Conflict(f"namespace {fingerprint[:12]} is registered with {existing.geometry}, not {geometry}")
            return existing
        num_slots = self._pool_bytes // geometry.block_bytes
        if num_slots < 1:
            raise InvalidRequest(f"one block is {geometry.block_bytes} bytes: larger than the whole L2 pool")
        name = new_segment_name()
        try:
            pool = SlabPool.create(name, geometry.block_bytes, num_slots)
        except ValueError as e:  # /dev/shm smaller than --host-cache-size-gb
            raise Exhausted(str(e)) from None
        namespace = Namespace(fingerprint, geometry, pool)
        self._namespaces[fingerprint] = namespace
        log.info("Radix cache enabled", extra={"namespace": fingerprint[:12], "capacity_blocks": num_slots,
                                               "segment": name})
        return namespace

    def namespace(self, fingerprint: str) -> Namespace:
        try:
            return self._namespaces[fingerprint]
        except KeyError:
            raise NotFound(f"namespace {fingerprint[:12]!r} is not registered") from None

    def _hashes(self, namespace: Namespace, cache_salt: str, token_ids: Sequence[int]):
        try:
            return block_hashes(namespace_key(namespace.fingerprint, cache_salt), token_ids, self._page_size)
        except ValueError as e:
            raise InvalidRequest(f"token_ids: {e}") from None

    # -- match and leases --------------------------------------------------------------------------------------
    def match(self, fingerprint: str, cache_salt: str, token_ids: Sequence[int], lease: bool,
              ttl_s: float | None = None) -> Match:
        """The longest cached prefix; with `lease`, its slots stay pinned until `release` or the TTL."""
        namespace = self.namespace(fingerprint)
        hashes = self._hashes(namespace, cache_salt, token_ids)
        result = namespace.index.match(hashes, lock=lease)
        l3_pages = 0
        if self.l3 is not None:
            self.l3.hit(namespace.fingerprint, namespace.pool, hashes, result.slots)
            l3_pages = self.l3.run_length(hashes, result.pages)
        lease_id, expires_unix_s = None, 0.0
        ttl_s = self._ttl_or_default(ttl_s)
        if result.lease is not None and result.pages == 0:
            namespace.index.unlock(result.lease)
        elif result.lease is not None:
            lease_id = self._hold(_Held(namespace, self._clock() + ttl_s, lease=result.lease))
            expires_unix_s = time.time() + ttl_s
        generations = tuple(namespace.pool.generation(slot) for slot in result.slots)
        return Match(result.pages, result.slots, lease_id, l3_pages, generations, expires_unix_s)

    def release(self, lease_id: str) -> None:
        held = self._held.get(lease_id)
        if held is None or held.lease is None:
            raise NotFound(f"lease {lease_id!r} is unknown or expired")
        self._drop(lease_id)

    # -- allocate and commit -----------------------------------------------------------------------------------
    def allocate(self, fingerprint: str, segment_name: str, count: int, ttl_s: float | None = None) -> Allocation:
        """Up to `count` free slots of `segment_name`, which must be the namespace's, evicting LRU pages to make
        room; fewer when the rest are pinned."""
        namespace = self.namespace(fingerprint)
        if segment_name != namespace.pool.name:
            raise Conflict(f"segment {segment_name!r} is not namespace {fingerprint[:12]}'s (kvcached restarted?): "
                           "register again")
        if not 0 <= count <= self._max_allocation_slots:
            raise InvalidRequest(f"count must be in [0, {self._max_allocation_slots}] (--max-allocation-slots), "
                                 f"got {count}")
        expires_at = self._clock() + self._ttl_or_default(ttl_s)
        evicted = self._make_room(namespace, count)
        slots = tuple(namespace.pool.allocate(count))
        namespace.allocated.update(slots)
        return Allocation(self._hold(_Held(namespace, expires_at, slots=frozenset(slots))), slots, evicted)

    def commit(self, fingerprint: str, cache_salt: str, token_ids: Sequence[int], first_page: int,
               slots: Sequence[int], allocation_id: str) -> Commit:
        """Caches pages [first_page, first_page + len(slots)) of `token_ids` in `slots` of the allocation.

        The allocation ends here: its slots that were not inserted return to the pool. Pages before `first_page`
        must still be cached (else nothing is inserted: the chain would have a gap).
        """
        namespace = self.namespace(fingerprint)
        if first_page < 0:
            raise InvalidRequest(f"first_page must be >= 0, got {first_page}")
        held = self._held.get(allocation_id)
        if held is None or held.lease is not None or held.namespace is not namespace:
            raise NotFound(f"allocation {allocation_id!r} is unknown, expired, or of another namespace")
        stray = set(slots) - held.slots
        if stray or len(set(slots)) != len(slots):
            raise InvalidRequest(f"slots {sorted(stray) or list(slots)} are not this allocation's, or repeat")
        hashes = self._hashes(namespace, cache_salt, token_ids)
        if first_page + len(slots) > len(hashes):
            raise InvalidRequest(f"pages [{first_page}, {first_page + len(slots)}) exceed the {len(hashes)} full "
                                 "pages of token_ids")
        result = namespace.index.insert(hashes[:first_page + len(slots)], slots, start=first_page)
        inserted = set(slots) - set(result.unused_slots)
        already_cached = max(0, result.cached_pages - first_page)
        end = first_page + len(slots)
        for page in range(end - result.inserted_pages, end):
            namespace.pool.set_key(result.slots[page], hashes[page])
        if self.l3 is not None and inserted:  # the inserted pages are the ones after those already cached
            self.l3.committed(namespace.fingerprint, namespace.pool, hashes, result.cached_pages,
                              slots[already_cached:])
        held.slots -= inserted
        namespace.allocated -= inserted
        self._drop(allocation_id)  # the allocation's other slots return to the pool
        return Commit(len(inserted), already_cached)

    def _make_room(self, namespace: Namespace, count: int) -> int:
        """Evicts least-recently-used unlocked pages until `count` slots are free (or nothing more can go)."""
        evicted = namespace.index.evict_blocks(max(0, count - namespace.pool.num_free))
        if self.l3 is not None:
            self.l3.evicted(namespace.fingerprint, namespace.pool, evicted)
        namespace.pool.free([block.slot for block in evicted])
        return len(evicted)

    # -- prefetch L3 -> L2 -------------------------------------------------------------------------------------
    def start_prefetch(self, fingerprint: str, cache_salt: str, token_ids: Sequence[int], match: Match
                       ) -> Prefetch | None:
        """Reserves L2 slots for the L3 run of `match` (of these tokens) and pins its L2 prefix; None when no slot
        is free. The same run already loading is not started twice: its prefetch is returned."""
        namespace = self.namespace(fingerprint)
        hashes = self._hashes(namespace, cache_salt, token_ids)[:match.pages + match.l3_pages]
        key = hashes[match.pages].hex()
        if key in self._prefetches:
            return self._prefetches[key]
        self._make_room(namespace, match.l3_pages)
        slots = namespace.pool.allocate(match.l3_pages)
        if not slots:
            return None
        namespace.allocated.update(slots)
        lease = namespace.index.match(hashes[:match.pages], lock=True).lease
        prefetch = Prefetch(key, namespace, hashes[:match.pages + len(slots)], match.pages, slots, lease)
        self._prefetches[key] = prefetch
        return prefetch

    def prefetched(self, prefetch: Prefetch) -> bool:
        """The next page's bytes are in its slot: caches it. False when the chain broke (stop loading)."""
        page = prefetch.first + prefetch.ready
        slot = prefetch.slots[prefetch.ready]
        result = prefetch.namespace.index.insert(prefetch.hashes[:page + 1], [slot], start=page)
        if result.cached_pages < page:
            return False
        if result.inserted_pages:
            prefetch.namespace.pool.set_key(slot, prefetch.hashes[page])
        prefetch.namespace.allocated.discard(slot)
        if slot in result.unused_slots:  # a worker committed the same page meanwhile
            prefetch.namespace.pool.free([slot])
        prefetch.ready += 1
        return True

    def end_prefetch(self, prefetch: Prefetch, keep: Sequence[int] = ()) -> None:
        """Frees the slots it did not load, except `keep` (a stuck read may still write them: see `free_slot`)."""
        namespace = prefetch.namespace
        unused = [s for s in prefetch.slots[prefetch.ready:] if s not in keep]
        namespace.stuck.update(keep)
        namespace.allocated.difference_update(unused)
        namespace.pool.free(unused)
        namespace.index.unlock(prefetch.lease)
        prefetch.done = True
        del self._prefetches[prefetch.prefetch_id]

    def free_slot(self, namespace: Namespace, slot: int) -> None:
        """Returns a slot a stuck prefetch read kept, once that read has ended."""
        namespace.stuck.remove(slot)
        namespace.allocated.discard(slot)
        namespace.pool.free([slot])

    def prefetch(self, prefetch_id: str) -> Prefetch | None:
        return self._prefetches.get(prefetch_id)

    # -- expiry and bookkeeping --------------------------------------------------------------------------------
    def expire(self) -> int:
        """Drops every lease and allocation past its TTL; returns how many."""
        now = self._clock()
        expired = [key for key, held in self._held.items() if held.expires_at <= now]
        for key in expired:
            self._drop(key)
        return len(expired)

    def _ttl_or_default(self, ttl_s: float | None) -> float:
        if ttl_s is not None and ttl_s > self._max_ttl_s:
            raise InvalidRequest(f"a TTL of {ttl_s:g} s exceeds the cap of {self._max_ttl_s:g} s (--max-lease-ttl-s)")
        return ttl_s or self._ttl

    def _hold(self, held: _Held) -> str:
        key = f"{next(self._ids):x}-{os.urandom(4).hex()}"
        self._held[key] = held
        return key

    def _drop(self, key: str) -> None:
        held = self._held.pop(key)
        if held.lease is not None:
            held.namespace.index.unlock(held.lease)
        held.namespace.allocated.difference_update(held.slots)
        held.namespace.pool.free(list(held.slots))

    def leases(self, namespace: Namespace | None = None) -> int:
        return sum(1 for held in list(self._held.values())  # a snapshot: metrics scrapes run on another thread
                   if held.lease is not None and namespace in (None, held.namespace))

    def namespaces(self) -> list[Namespace]:
        return list(self._namespaces.values())

    def allocations(self, namespace: Namespace | None = None) -> int:
        return sum(1 for held in self._held.values()
                   if held.lease is None and namespace in (None, held.namespace))

    def check_integrity(self) -> None:
        """Raises AssertionError unless, per namespace, free + allocated + cached slots = total, the allocated set
        is exactly the live allocations' slots (each in one allocation), and index and pool are consistent."""
        held_slots = {id(ns): [] for ns in self._namespaces.values()}
        for held in self._held.values():
            held_slots[id(held.namespace)] += held.slots
        for prefetch in self._prefetches.values():
            held_slots[id(prefetch.namespace)] += prefetch.slots[prefetch.ready:]
        for namespace in self._namespaces.values():
            namespace.index.check_integrity()
            namespace.pool.check_integrity()
            slots = held_slots[id(namespace)] + list(namespace.stuck)
            if len(slots) != len(set(slots)) or set(slots) != namespace.allocated:
                raise AssertionError(f"allocated slots {sorted(namespace.allocated)} != the allocations' {slots}")
            cached, allocated = namespace.index.total_pages, len(namespace.allocated)
            if namespace.pool.num_free + allocated + cached != namespace.pool.num_slots:
                raise AssertionError(f"free {namespace.pool.num_free} + allocated {allocated} + cached {cached} "
                                     f"!= total {namespace.pool.num_slots}")

    def close(self) -> None:
        """Unlinks every pool; the cache is unusable afterwards."""
        for namespace in self._namespaces.values():
            try:
                namespace.pool.close()
            except BufferError:  # a disk writer that outlived its close() timeout is copying from it; unlink anyway
                log.warning("an L2 pool was still in use at close", extra={"fingerprint": namespace.fingerprint})
            namespace.pool.unlink()
        self._namespaces.clear()
        self._held.clear()
