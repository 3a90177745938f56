import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule

from radixserve.blocks.keys import block_hashes, namespace_key
from radixserve.blocks.radix import InsertResult, MatchResult, RadixIndex

PAGE = 4
NS = namespace_key("test-model", "")


def pages(*page_ids: int) -> list:
    """Hashes of a prompt whose i-th page is four copies of page_ids[i]."""
    return block_hashes(NS, [t for p in page_ids for t in [p] * PAGE], PAGE)


A = pages(1, 2, 3)  # A and B share two pages
B = pages(1, 2, 7, 8)
C = pages(9)


@pytest.fixture
def index():
    idx = RadixIndex()
    yield idx
    idx.check_integrity()


def test_empty_index(index):
    assert index.match(A) == MatchResult(0, (), None)
    assert index.evict(0) == []
    assert index.evict(5) == []
    assert index.total_pages == 0


def test_insert_then_match_prefixes(index):
    assert index.insert(A, [10, 11, 12]) == InsertResult(0, 3, (), (10, 11, 12), None)
    assert index.match(A) == MatchResult(3, (10, 11, 12), None)
    assert index.match(A[:2]) == MatchResult(2, (10, 11), None)
    assert index.match(pages(1, 2, 3, 4)) == MatchResult(3, (10, 11, 12), None)
    assert index.match(pages(1, 5)) == MatchResult(1, (10,), None)
    assert index.match(pages(2)) == MatchResult(0, (), None)


def test_insert_shared_prefix_keeps_existing_slots(index):
    index.insert(A, [0, 1, 2])
    assert index.insert(B, [5, 6, 7, 8]) == InsertResult(2, 2, (5, 6), (0, 1, 7, 8), None)
    assert index.match(B).slots == (0, 1, 7, 8)
    assert index.match(A).slots == (0, 1, 2)
    assert index.total_pages == 5


def test_insert_of_cached_pages_takes_nothing(index):
    index.insert(A, [0, 1, 2])
    assert index.insert(A[:2], [5, 6]) == InsertResult(2, 0, (5, 6), (0, 1), None)
    assert index.total_pages == 3


def test_offering_a_cached_page_its_own_slot_counts_as_taken(index):
    index.insert(A, [0, 1, 2])
    assert index.insert(B, [0, 1, 7, 8]) == InsertResult(2, 2, (), (0, 1, 7, 8), None)
    assert index.insert(B, [0, 5, 7, 8]) == InsertResult(4, 0, (5,), (0, 1, 7, 8), None)


def test_insert_extends_a_leaf(index):
    index.insert(A[:1], [0])
    assert index.insert(A, [5, 1, 2]) == InsertResult(1, 2, (5,), (0, 1, 2), None)
    assert index.match(A).slots == (0, 1, 2)


def test_insert_after_a_cached_prefix_takes_slots_for_the_new_pages_only(index):
    index.insert(A[:1], [0])
    assert index.insert(B, [6, 7, 8], start=1) == InsertResult(1, 3, (), (0, 6, 7, 8), None)
    assert index.insert(A, [9, 3], start=1) == InsertResult(2, 1, (9,), (0, 6, 3), None)  # page 2 is cached


def test_insert_after_a_gap_inserts_nothing_and_returns_every_slot(index):
    index.insert(A[:1], [0])
    assert index.insert(B, [7, 8], start=2) == InsertResult(1, 0, (7, 8), (0,), None)
    assert index.insert(B, [7, 8], start=2, lock=True).lease is None
    assert index.total_pages == 1 and index.locked_pages == 0


@pytest.mark.parametrize("start, slots", [(-1, [0, 1, 2, 3]), (4, [0]), (1, [0])])
def test_insert_slots_must_cover_the_pages_after_start(index, start, slots):
    with pytest.raises(ValueError, match="slots for the pages from"):
        index.insert(A, slots, start=start)
    assert index.total_pages == 0


def test_insert_with_lock_pins_the_whole_path_and_share_pins_it_again(index):
    index.insert(A[:1], [0])
    result = index.insert(A, [1, 2], start=1, lock=True)
    shared = index.share(result.lease)
    assert index.locked_pages == 3 and index.evict(3) == []
    index.unlock(result.lease)
    assert index.evict(3) == []  # the shared lease still pins it
    index.unlock(shared)
    assert index.evict(3) == [2, 1, 0]
    with pytest.raises(ValueError, match="already released"):
        index.share(shared)


def test_eviction_order_is_lru_leaf_first_far_end_first(index):
    index.insert(A, [0, 1, 2])  # tick 1
    index.insert(B, [5, 6, 7, 8])  # tick 2: splits A after two pages
    index.insert(C, [9])  # tick 3
    assert index.evict(1) == [2]  # A's own leaf is least recently used
    assert index.evict(1) == [8]  # then B's leaf, from its far end
    assert index.evict(2) == [7, 1]  # B's leaf empties, so the shared edge becomes a leaf
    assert index.evict(10) == [0, 9]
    assert index.total_pages == 0


def test_match_refreshes_lru(index):
    index.insert(A, [0, 1, 2])
    index.insert(C, [9])
    index.match(A)
    assert index.evict(1) == [9]


def test_partial_match_refreshes_the_whole_edge(index):
    index.insert(A, [0, 1, 2])
    index.insert(C, [9])
    index.match(A[:1])
    assert index.evict(1) == [9]


@pytest.mark.parametrize("n, freed, left", [
    (0, [], (0, 1, 2)),
    (1, [2], (0, 1)),
    (2, [2, 1], (0,)),
    (3, [2, 1, 0], ()),
    (4, [2, 1, 0], ()),
])
def test_evict_n_pages_from_one_leaf(index, n, freed, left):
    index.insert(A, [0, 1, 2])
    assert index.evict(n) == freed
    assert index.match(A).slots == left
    assert index.total_pages == len(left)


def test_lease_pins_the_matched_path(index):
    index.insert(A, [0, 1, 2])
    index.insert(B, [5, 6, 7, 8])
    lease = index.match(A, lock=True).lease
    assert (index.locked_pages, index.evictable_pages) == (3, 2)
    assert index.evict(10) == [8, 7]
    index.unlock(lease)
    assert index.locked_pages == 0
    assert index.evict(10) == [2, 1, 0]


def test_lease_pins_the_whole_edge_a_match_ends_in(index):
    index.insert(A, [0, 1, 2])
    lease = index.match(A[:1], lock=True).lease
    assert index.locked_pages == 3
    assert index.evict(3) == []
    index.unlock(lease)
    assert index.evict(3) == [2, 1, 0]


def test_leases_count_per_path(index):
    index.insert(A, [0, 1, 2])
    first = index.match(A, lock=True).lease
    second = index.match(A[:2], lock=True).lease
    index.unlock(first)
    assert index.evict(10) == []
    index.unlock(second)
    assert index.evict(10) == [2, 1, 0]


def test_lease_survives_a_split_below_its_match(index):
    index.insert(A, [0, 1, 2])
    lease = index.match(A, lock=True).lease
    index.insert(B, [5, 6, 7, 8])  # splits A's locked edge
    index.check_integrity()
    assert index.locked_pages == 3
    assert index.evict(10) == [8, 7]
    index.unlock(lease)
    assert index.evict(10) == [2, 1, 0]


def test_lock_with_no_match_pins_nothing(index):
    index.insert(A, [0, 1, 2])
    result = index.match(C, lock=True)
    assert result.pages == 0 and result.lease is not None
    assert index.locked_pages == 0
    index.unlock(result.lease)


def test_unlock_twice_raises(index):
    index.insert(A, [0, 1, 2])
    lease = index.match(A, lock=True).lease
    index.unlock(lease)
    with pytest.raises(ValueError, match="already released"):
        index.unlock(lease)


def test_unlock_foreign_lease_raises(index):
    other = RadixIndex()
    other.insert(A, [0, 1, 2])
    with pytest.raises(ValueError, match="not from this index"):
        index.unlock(other.match(A, lock=True).lease)


@pytest.mark.parametrize("hashes, slots, message", [
    (A, [0, 1], "3 hashes but 2 slots"),
    (C, [0], "already in the index"),
    (B, [5, 6, 7, 7], "distinct"),
    (B, [5, 0, 7, 8], "already in the index"),  # slot 0 holds another page: freeing it would corrupt the cache
    (B, [1, 6, 7, 8], "already in the index"),
])
def test_bad_insert_raises_and_changes_nothing(index, hashes, slots, message):
    index.insert(A, [0, 1, 2])
    with pytest.raises(ValueError, match=message):
        index.insert(hashes, slots)
    assert index.total_pages == 3
    assert index.match(B).pages == 2


def test_reinsert_after_eviction_reuses_the_offered_slots(index):
    index.insert(A, [0, 1, 2])
    assert index.evict(2) == [2, 1]
    assert index.insert(A, [1, 2, 3]) == InsertResult(1, 2, (1,), (0, 2, 3), None)
    assert index.match(A).slots == (0, 2, 3)


def test_heap_stays_bounded_under_repeated_matches(index):
    index.insert(A, [0, 1, 2])
    index.insert(B, [5, 6, 7, 8])
    for _ in range(100):
        index.match(A)
        index.match(B)
    assert len(index._heap) <= 3


# ---- stateful test against a reference model ---------------------------------------------------------------------

PATHS = st.lists(st.integers(0, 2), min_size=0, max_size=6).map(tuple)


class RadixAgainstReference(RuleBasedStateMachine):
    """Reference: a dict from page-id prefix (a tuple) to slot, kept prefix-closed, plus the prefixes leases pin.

    The index pins whole edges, so after eviction it may keep more than the minimum; the checks allow that.
    """

    leases = Bundle("leases")

    def __init__(self):
        super().__init__()
        self.index = RadixIndex()
        self.ref: dict[tuple, int] = {}
        self.pinned: dict[object, tuple] = {}  # lease -> matched prefix
        self.by_slot: dict[int, tuple] = {}
        self.next_slot = itertools.count()

    def cached_prefix(self, path: tuple) -> int:
        return next((k for k in range(len(path), 0, -1) if path[:k] in self.ref), 0)

    @rule(target=leases, path=PATHS, offer_cached_slots=st.booleans(), start=st.integers(0, 6), lock=st.booleans())
    def insert(self, path, offer_cached_slots, start, lock):
        start = min(start, len(path))
        slots = [next(self.next_slot) for _ in path]
        cached = self.cached_prefix(path)
        kept = tuple(self.ref[path[:k + 1]] for k in range(cached))
        if offer_cached_slots:
            slots[:cached] = kept
        result = self.index.insert(pages(*path), slots[start:], start=start, lock=lock)
        if cached < start:  # a gap: nothing cached
            assert result == InsertResult(cached, 0, tuple(slots[start:]), kept, None)
            return multiple()
        unused = () if offer_cached_slots else tuple(slots[start:cached])
        assert result == InsertResult(cached, len(path) - cached, unused, kept + tuple(slots[cached:]),
                                      result.lease)
        assert (result.lease is not None) == lock
        for k in range(cached, len(path)):
            self.ref[path[:k + 1]] = slots[k]
            self.by_slot[slots[k]] = path[:k + 1]
        if not lock:
            return multiple()
        self.pinned[result.lease] = path
        return result.lease

    @rule(target=leases, lease=leases)
    def share(self, lease):
        shared = self.index.share(lease)
        self.pinned[shared] = self.pinned[lease]
        return shared

    @rule(target=leases, path=PATHS)
    def match_and_lock(self, path):
        result = self.check_match(path, lock=True)
        self.pinned[result.lease] = path[:result.pages]
        return result.lease

    @rule(path=PATHS)
    def match(self, path):
        self.check_match(path, lock=False)

    def check_match(self, path, lock):
        k = self.cached_prefix(path)
        result = self.index.match(pages(*path), lock=lock)
        assert (result.pages, result.slots) == (k, tuple(self.ref[path[:i + 1]] for i in range(k)))
        return result

    @rule(lease=consumes(leases))
    def unlock(self, lease):
        self.index.unlock(lease)
        del self.pinned[lease]

    @rule(n=st.integers(0, 8))
    def evict(self, n):
        freed = self.index.evict(n)
        assert len(freed) <= n and len(set(freed)) == len(freed)
        evicted = [self.by_slot.pop(s) for s in freed]
        locked = {p[:k] for p in self.pinned.values() for k in range(1, len(p) + 1)}
        assert not locked & set(evicted), "evicted a pinned page"
        for prefix in evicted:  # far end first: a page leaves after all of its descendants
            del self.ref[prefix]
            assert not any(p[:len(prefix)] == prefix for p in self.ref), "evicted a page that has descendants"
        if len(freed) < n:
            assert self.index.evictable_pages == 0

    @invariant()
    def consistent(self):
        self.index.check_integrity()
        assert self.index.total_pages == len(self.ref)
        assert self.index.locked_pages >= len({p[:k] for p in self.pinned.values() for k in range(1, len(p) + 1)})


TestRadixAgainstReference = RadixAgainstReference.TestCase
TestRadixAgainstReference.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
