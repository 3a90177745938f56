"""The radix prefix index: which pages of a prompt are cached, and where.

A radix tree over block hashes (`radixserve.blocks.keys`). Each edge holds a run of page hashes and, per page, the
slot that holds the page in the tier the index covers: kvcached indexes its L2 shared-memory slots with it, a model
worker its L1 pool pages. Pure Python, no I/O, not thread-safe: each process calls it from one thread (or under
one lock).

Keys must be chained, each committing to its whole prefix, as `block_hashes` makes them: a walk compares only the
first and last key of each edge, so a 256-page match costs one step per node, not per page.

Contract
- `match` finds the longest cached prefix. It does not modify the cache; it only refreshes LRU order and, with
  `lock=True`, returns a `Lease` that pins the matched path until `unlock(lease)`.
- `insert` adds pages after a cached prefix; pages already present keep their slot, and the result lists the
  offered slots it did not take, which the caller frees. With `lock=True` it also leases the whole path, so a
  caller never needs a second `match` to pin what it just cached. `share(lease)` pins the same path again.
- `evict(n)` removes up to `n` unlocked pages, least recently used leaves first, each leaf from its far end, and
  returns their slots for the caller to free. A slot returned by `evict` is no longer referenced by the index.
  `evict(0)` is always safe.
- A slot in a `MatchResult` stays valid (not evicted, not reused) while its lease is held; without a lease, only
  until the next `evict`.

Namespaces: one index serves every namespace. Keys are chained hashes that commit to the namespace, so prefixes of
different namespaces never share a node, and one LRU order spans the shared L2 pool.

Tiers: the index covers one tier. Eviction works from the leaf end, so the cached pages of a path always form a
prefix of it; in kvcached the disk tier's pages after that prefix are tracked apart (`kvcached.l3`).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from radixserve.blocks.keys import BlockHash


class Lease:
    """Pins the pages of one match against eviction until `RadixIndex.unlock(lease)`; release it exactly once.

    A lease pins whole edges, so when a match ends inside an edge it also pins that edge's pages past the match.
    """

    __slots__ = ("_node",)

    def __init__(self, node: _Node) -> None:
        self._node = node


class MatchResult(NamedTuple):
    pages: int  # length of the longest cached prefix, in pages
    slots: tuple[int, ...]  # where each matched page lives in the index's tier, in prompt order; len == pages
    lease: Lease | None  # set by match(lock=True), else None


class InsertResult(NamedTuple):
    cached_pages: int  # leading pages that were already cached; below `start`, a gap: nothing was inserted
    inserted_pages: int  # pages added, with the offered slots
    unused_slots: tuple[int, ...]  # offered slots the index did not take: the caller frees them (and only them)
    slots: tuple[int, ...]  # the slot of each page now cached on the path, in prompt order
    lease: Lease | None  # set by insert(lock=True), else None; pins `slots`


class EvictedBlock(NamedTuple):
    block_hash: BlockHash
    parent_hash: BlockHash | None  # None for the first page of a prompt
    slot: int


class _Node:
    __slots__ = ("parent", "hashes", "slots", "children", "lock_ref", "last_access", "in_heap")

    def __init__(self, parent: _Node | None, hashes: list[BlockHash], slots: list[int]) -> None:
        self.parent = parent  # None for the root and for detached (evicted) nodes
        self.hashes = hashes
        self.slots = slots
        self.children: dict[BlockHash, _Node] = {}  # keyed by the child's first hash
        self.lock_ref = 0  # live leases whose path runs through this node
        self.last_access = 0  # RadixIndex clock tick; never newer than the parent's
        self.in_heap = False  # has an entry in the eviction heap


class _Walk(NamedTuple):
    node: _Node  # deepest node that matched at least one page (the root if none)
    in_node: int  # pages of `node` that matched
    pages: int  # pages matched in all
    slots: list[int]


class RadixIndex:
    """A radix tree of cached pages with per-path lock counts and LRU eviction.

    LRU uses a logical clock (one tick per match or insert), so tests are deterministic. Evictable leaves sit in a
    min-heap keyed by the tick they were pushed with; a touch does not re-push, so a popped entry older than its
    node's tick is re-pushed instead of evicted. Each node has at most one heap entry.
    """

    def __init__(self) -> None:
        self._root = _Node(None, [], [])
        self._clock = 0
        self._heap: list[tuple[int, int, _Node]] = []
        self._seq = itertools.count()  # heap tie-break, so entries never compare nodes
        self._slots: set[int] = set()
        self._leases: set[Lease] = set()
        self._total_pages = 0
        self._locked_pages = 0

    @property
    def total_pages(self) -> int:
        return self._total_pages

    @property
    def locked_pages(self) -> int:
        return self._locked_pages

    @property
    def evictable_pages(self) -> int:
        return self._total_pages - self._locked_pages

    def match(self, hashes: Sequence[BlockHash], lock: bool = False) -> MatchResult:
        """The longest cached prefix of `hashes`. Does not modify the cache: it only refreshes the LRU order of the
        matched path and, with `lock=True`, pins it under the returned lease (also when nothing matched)."""
        walk = self._walk(hashes)
        walk.node.last_access = self._clock  # a match that ends inside an edge refreshes all of it
        lease = self._lock(walk.node) if lock else None
        return MatchResult(walk.pages, tuple(walk.slots), lease)

    def insert(self, hashes: Sequence[BlockHash], slots: Sequence[int], start: int = 0,
               lock: bool = False) -> InsertResult:
        """Caches page i of `hashes` (i >= `start`) in `slots[i - start]`, after the first `start` pages, which
        must already be cached. Leading pages already cached keep their slot.

            hashes:  | cached prefix (>= start pages) | new pages: their offered slots are taken |
                     0                                 cached_pages                              len(hashes)

        A gap (fewer than `start` pages cached, say evicted meanwhile) inserts nothing: every offered slot comes
        back unused and `cached_pages < start`. Offering a cached page its own slot is fine (say, slots from a
        match): that slot counts as taken. Splits an edge where the new pages branch off; refreshes the path's LRU
        order; with `lock=True` leases the path (`lease` is None after a gap). Raises ValueError, caching nothing,
        when the lengths disagree or an offered slot is offered twice or already holds another cached page.
        """
        if not 0 <= start <= len(hashes) or len(hashes) - start != len(slots):
            raise ValueError(f"{len(hashes)} hashes but {len(slots)} slots for the pages from {start}")
        walk = self._walk(hashes)
        if walk.pages < start:
            walk.node.last_access = self._clock
            return InsertResult(walk.pages, 0, tuple(slots), tuple(walk.slots), None)
        new_slots = list(slots[walk.pages - start:])
        unused = [offered for offered, kept in zip(slots[:walk.pages - start], walk.slots[start:], strict=True)
                  if offered != kept]
        self._require_fresh(new_slots + unused)
        node = walk.node
        if new_slots and walk.in_node < len(node.hashes):
            node = self._split(node, walk.in_node)  # the lower part keeps its older tick
        node.last_access = self._clock
        if new_slots:
            node = self._add_leaf(node, list(hashes[walk.pages:]), new_slots)
        self._maybe_push(node)
        lease = self._lock(node) if lock else None
        return InsertResult(walk.pages, len(new_slots), tuple(unused), (*walk.slots, *new_slots), lease)

    def share(self, lease: Lease) -> Lease:
        """Another lease on the pages `lease` pins, released on its own. Raises ValueError for a released lease."""
        if lease not in self._leases:
            raise ValueError("lease already released or not from this index")
        return self._lock(lease._node)

    def unlock(self, lease: Lease) -> None:
        """Releases `lease`; its pages become evictable once no other lease pins them. Raises ValueError when the
        lease was already released or comes from another index."""
        if lease not in self._leases:
            raise ValueError("lease already released or not from this index")
        self._leases.remove(lease)
        node = lease._node
        while node is not None:
            node.lock_ref -= 1
            self._locked_pages -= 0 if node.lock_ref else len(node.hashes)
            node = node.parent
        self._maybe_push(lease._node)  # the only node on the path that can be a leaf

    def evict(self, n_pages: int) -> list[int]:
        """Removes up to `n_pages` unlocked pages and returns their slots, now the caller's to free.

        Takes the least recently used unlocked leaf, page by page from its far end; a leaf emptied this way is
        removed, which may make its parent the next candidate. Returns fewer slots when nothing else is evictable.
        """
        return [block.slot for block in self.evict_blocks(n_pages)]

    def evict_blocks(self, n_pages: int) -> list[EvictedBlock]:
        """`evict`, also naming each page and its parent page (what a write-back to disk needs)."""
        freed: list[EvictedBlock] = []
        while len(freed) < n_pages and self._heap:
            tick, _, node = heapq.heappop(self._heap)
            node.in_heap = False
            if not self._is_evictable_leaf(node):
                continue
            if tick < node.last_access:
                self._push(node)
                continue
            freed += self._trim(node, n_pages - len(freed))
        return freed

    def check_integrity(self) -> None:
        """Raises AssertionError unless every invariant holds: tree links and child keys, lock counts along paths,
        page and slot accounting, LRU ticks monotone toward the root, and heap coverage of evictable leaves."""
        anchored = Counter(lease._node for lease in self._leases)
        seen_slots: list[int] = []
        locked = unlocked = in_heap = 0
        nodes = set()
        for node in self._nodes():
            nodes.add(node)
            self._check_node(node, anchored[node])
            seen_slots += node.slots
            locked += len(node.hashes) if node.lock_ref else 0
            unlocked += 0 if node.lock_ref else len(node.hashes)
            in_heap += node.in_heap
        _require(anchored.keys() <= nodes, "a live lease pins a detached node")
        _require((locked, unlocked) == (self._locked_pages, self.evictable_pages), "page counts disagree")
        _require(len(seen_slots) == len(set(seen_slots)), "a slot appears twice")
        _require(set(seen_slots) == self._slots, "slot set disagrees with the tree")
        _require(in_heap == len(self._heap), "heap entries and in_heap flags disagree")

    def _check_node(self, node: _Node, anchored: int) -> None:
        _require(node.lock_ref == anchored + sum(c.lock_ref for c in node.children.values()), "lock_ref mismatch")
        _require(not self._is_evictable_leaf(node) or node.in_heap, "evictable leaf missing from the heap")
        if node is self._root:
            return
        _require(len(node.hashes) == len(node.slots) > 0, "edge hashes and slots disagree")
        _require(node.parent.children.get(node.hashes[0]) is node, "child key does not match its edge")
        _require(node.last_access <= node.parent.last_access, "a node is newer than its parent")

    def _require_fresh(self, slots: list[int]) -> None:
        if len(set(slots)) != len(slots) or not self._slots.isdisjoint(slots):
            raise ValueError(f"offered slots must be distinct and not already in the index: {slots}")

    def _walk(self, hashes: Sequence[BlockHash]) -> _Walk:
        """Follows `hashes` down from the root. Stamps a new clock tick (the LRU touch) on every node it matches
        in full; a last node matched only in part is left for the caller to stamp."""
        self._clock += 1
        node, pages, slots, n = self._root, 0, [], len(hashes)
        node.last_access = self._clock
        while pages < n:
            child = node.children.get(hashes[pages])
            if child is None:
                break
            end = pages + len(child.hashes)
            if end > n or hashes[end - 1] != child.hashes[-1]:  # the match ends inside this edge
                in_node = _common_prefix(child.hashes, hashes, pages)
                return _Walk(child, in_node, pages + in_node, slots + child.slots[:in_node])
            node, pages = child, end
            node.last_access = self._clock
            slots += child.slots
        return _Walk(node, len(node.hashes), pages, slots)

    def _lock(self, node: _Node) -> Lease:
        lease = Lease(node)
        self._leases.add(lease)
        while node is not None:
            self._locked_pages += 0 if node.lock_ref else len(node.hashes)
            node.lock_ref += 1
            node = node.parent
        return lease

    def _split(self, node: _Node, k: int) -> _Node:
        """Cuts `node`'s edge after `k` pages and returns the new upper node. `node` keeps the lower part and its
        identity, so leases and heap entries that refer to it stay valid."""
        upper = _Node(node.parent, node.hashes[:k], node.slots[:k])
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        node.parent.children[upper.hashes[0]] = upper
        node.hashes, node.slots, node.parent = node.hashes[k:], node.slots[k:], upper
        upper.children[node.hashes[0]] = node
        return upper

    def _add_leaf(self, parent: _Node, hashes: list[BlockHash], slots: list[int]) -> _Node:
        leaf = _Node(parent, hashes, slots)
        leaf.last_access = self._clock
        parent.children[hashes[0]] = leaf
        self._slots.update(slots)
        self._total_pages += len(slots)
        return leaf

    def _trim(self, leaf: _Node, n_pages: int) -> list[EvictedBlock]:
        """Removes up to `n_pages` from the far end of an evictable `leaf` (popped from the heap); returns them,
        far end first. An emptied leaf is detached, and its parent may become an evictable leaf."""
        key, cut = leaf.hashes[0], max(len(leaf.hashes) - n_pages, 0)
        parents = [leaf.parent.hashes[-1] if leaf.parent.hashes else None] + leaf.hashes[:-1]
        freed = [EvictedBlock(h, p, s) for h, p, s in zip(leaf.hashes[cut:], parents[cut:], leaf.slots[cut:])][::-1]
        del leaf.hashes[cut:], leaf.slots[cut:]
        self._slots.difference_update(b.slot for b in freed)
        self._total_pages -= len(freed)
        if leaf.hashes:
            self._push(leaf)
        else:
            parent, leaf.parent = leaf.parent, None
            del parent.children[key]
            self._maybe_push(parent)
        return freed

    def _is_evictable_leaf(self, node: _Node) -> bool:
        return node.parent is not None and not node.children and node.lock_ref == 0

    def _maybe_push(self, node: _Node) -> None:
        if not node.in_heap and self._is_evictable_leaf(node):
            self._push(node)

    def _push(self, node: _Node) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._seq), node))
        node.in_heap = True

    def _nodes(self) -> Iterator[_Node]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _common_prefix(edge: list[BlockHash], hashes: Sequence[BlockHash], start: int) -> int:
    """How many leading pages of `edge` equal `hashes[start:]`; the caller has matched the first already."""
    k = 1
    while k < len(edge) and start + k < len(hashes) and edge[k] == hashes[start + k]:
        k += 1
    return k


def _require(ok: bool, what: str) -> None:
    # Not `assert`: the check must also run under `python -O`.
    if not ok:
        raise AssertionError(what)
