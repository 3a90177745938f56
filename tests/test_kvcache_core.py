"""Exact tests of `kvcached.cache.KVCache`: page size 4, 256-byte blocks, a pool of 8 slots, a fake clock.

Slot numbers are exact: a fresh pool hands out slots 0, 1, 2, ... in order, and freed slots come back last-in
first-out (see tests/test_dram_shm.py). `check_integrity()` runs after every call through the `cache` fixture.
"""

import os
from dataclasses import replace

import pytest

from kvcached.cache import Commit, Conflict, Exhausted, InvalidRequest, KVCache, Match, NotFound
from radixserve.blocks.keys import block_hashes, namespace_key
from radixserve.blocks.slab import EMPTY_KEY, SEGMENT_PREFIX, SHM_DIR
from tests.kvcache_helpers import BLOCK, FP, GEO, PAGE, SLOTS, TTL, Checked, FakeClock, segment, toks

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs Linux /dev/shm")

def ours() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"{SEGMENT_PREFIX}{os.getpid()}_")}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def cache(clock):
    before = ours()
    raw = KVCache(SLOTS * BLOCK, PAGE, TTL, clock=clock)
    yield Checked(raw)
    raw.check_integrity()
    raw.close()
    assert ours() == before, "a pool segment outlived KVCache.close()"


@pytest.fixture
def ns(cache):
    return cache.register(FP, GEO)


def state(cache: Checked) -> list[tuple]:
    """Everything observable about the cache's contents, to compare before and after a rejected call."""
    return [(n.fingerprint, n.pool.num_free, frozenset(n.allocated), n.index.total_pages, cache.raw.leases(n))
            for n in cache.raw.namespaces()]


def put(cache: Checked, token_ids: list[int], first_page: int = 0, salt: str = "") -> tuple[int, ...]:
    """Allocates and commits pages [first_page, full pages) of `token_ids`; returns their slots."""
    count = len(token_ids) // PAGE - first_page
    allocation = cache.allocate(FP, segment(cache), count)
    assert len(allocation.slots) == count
    commit = cache.commit(FP, salt, token_ids, first_page, allocation.slots, allocation.allocation_id)
    assert commit == Commit(count, 0)
    return allocation.slots


# -- namespaces -----------------------------------------------------------------------------------------------------
def test_register_creates_one_pool_sized_by_the_block(cache):
    ns = cache.register(FP, GEO)
    assert GEO.block_bytes == BLOCK
    assert (ns.pool.num_slots, ns.pool.slot_bytes, ns.pool.num_free) == (SLOTS, BLOCK, SLOTS)
    assert ns.pool.name in ours()


def test_register_is_idempotent(cache):
    first = cache.register(FP, GEO)
    segments = ours()
    assert cache.register(FP, GEO) is first
    assert ours() == segments
    assert cache.namespaces() == [first]


def test_namespaces_get_separate_pools(cache):
    a, b = cache.register("a", GEO), cache.register("b", GEO)
    assert a.pool.name != b.pool.name
    assert [n.fingerprint for n in cache.namespaces()] == ["a", "b"]


@pytest.mark.parametrize("change, error, message", [
    (dict(head_dim=8), Conflict, "registered with"),
    (dict(num_layers=3), Conflict, "registered with"),
    (dict(dtype="bfloat16"), Conflict, "registered with"),
    (dict(layout="layer-first"), Conflict, "registered with"),
    (dict(page_size=8), Conflict, "page_size 8 != kvcached --page-size 4"),
    (dict(dtype="int8"), ValueError, "dtype 'int8'"),  # BlockGeometry refuses it before register sees it
])
def test_register_disagreeing_with_existing_namespace(cache, ns, change, error, message):
    before = state(cache)
    with pytest.raises(error, match=message):
        cache.register(FP, replace(GEO, **change))
    assert state(cache) == before
    assert cache.namespace(FP) is ns


@pytest.mark.parametrize("fingerprint, change, error, message", [
    ("m", dict(page_size=16), Conflict, "page_size 16"),
    ("m", dict(dtype="float64"), ValueError, "dtype 'float64'"),
    ("m", dict(dtype=""), ValueError, "dtype ''"),
    ("m", dict(num_layers=0), ValueError, "must be >= 1"),
    ("m", dict(num_kv_heads=0), ValueError, "must be >= 1"),
    ("m", dict(head_dim=0), ValueError, "must be >= 1"),
    ("", {}, InvalidRequest, "must be 1-256 bytes"),
    ("f" * 257, {}, InvalidRequest, "must be 1-256 bytes"),
    ("m", dict(num_layers=SLOTS + 1, head_dim=SLOTS * 4), InvalidRequest, "larger than the whole L2 pool"),
])
def test_register_rejects_bad_first_registration(cache, fingerprint, change, error, message):
    segments = ours()
    with pytest.raises(error, match=message):
        cache.register(fingerprint, replace(GEO, **change))
    assert cache.namespaces() == []
    assert ours() == segments
    with pytest.raises(NotFound):
        cache.namespace(fingerprint)


def test_register_without_room_in_dev_shm_is_exhausted(cache, monkeypatch):
    monkeypatch.setattr("kvcached.tiers.dram_shm._free_bytes", lambda path: BLOCK)
    segments = ours()
    with pytest.raises(Exhausted, match="bytes free"):
        cache.register(FP, GEO)
    assert cache.namespaces() == [] and ours() == segments


@pytest.mark.parametrize("call", [
    lambda c: c.match("nope", "", toks(1), lease=True),
    lambda c: c.allocate("nope", "radixserve_1_00000000", 1),
    lambda c: c.commit("nope", "", toks(1), 0, [], "1-00"),
    lambda c: c.namespace("nope"),
])
def test_unknown_namespace_is_not_found(cache, ns, call):
    with pytest.raises(NotFound, match="'nope' is not registered"):
        call(cache)


# -- match, lease, release ------------------------------------------------------------------------------------------
def test_match_on_empty_cache_has_no_lease(cache, ns):
    assert cache.match(FP, "", toks(1, 2), lease=True) == Match(0, (), None)
    assert cache.leases() == 0
    assert ns.index.locked_pages == 0


def test_match_lease_release(cache, ns):
    slots = put(cache, toks(1, 2, 3, tail=2))
    assert slots == (0, 1, 2)
    match = cache.match(FP, "", toks(1, 2, 5), lease=True)
    assert (match.pages, match.l2_slots) == (2, (0, 1))
    assert match.lease_id and cache.leases(ns) == 1
    assert ns.index.locked_pages == 3  # the lease pins the whole edge, page 3 included
    cache.release(match.lease_id)
    assert cache.leases() == 0 and ns.index.locked_pages == 0
    with pytest.raises(NotFound, match="unknown or expired"):
        cache.release(match.lease_id)


def test_match_without_lease_takes_no_lease(cache, ns):
    put(cache, toks(1, 2))
    assert cache.match(FP, "", toks(1, 2), lease=False) == Match(2, (0, 1), None, 0, (1, 1))
    assert cache.leases() == 0 and ns.index.locked_pages == 0


def test_two_leases_on_one_prefix_are_independent(cache, ns):
    put(cache, toks(1, 2))
    a = cache.match(FP, "", toks(1, 2), lease=True)
    b = cache.match(FP, "", toks(1), lease=True)
    assert a.lease_id != b.lease_id and cache.leases() == 2
    cache.release(a.lease_id)
    assert ns.index.locked_pages == 2  # b still pins the edge
    cache.release(b.lease_id)
    assert ns.index.locked_pages == 0


@pytest.mark.parametrize("prompt, expected", [
    (toks(1, 2, 3), Match(3, (0, 1, 2), None, 0, (1, 1, 1))),
    (toks(1, 2, 3, 4, tail=3), Match(3, (0, 1, 2), None, 0, (1, 1, 1))),
    (toks(1, 2), Match(2, (0, 1), None, 0, (1, 1))),
    (toks(1, tail=3), Match(1, (0,), None, 0, (1,))),
    (toks(tail=3), Match(0, (), None)),
    (toks(2, 3), Match(0, (), None)),
])
def test_commit_then_match_finds_exact_slots(cache, ns, prompt, expected):
    put(cache, toks(1, 2, 3, tail=1))
    assert cache.match(FP, "", prompt, lease=False) == expected


def test_cache_salt_separates_tenants(cache, ns):
    put(cache, toks(1, 2), salt="tenant-a")
    assert cache.match(FP, "tenant-b", toks(1, 2), lease=False).pages == 0
    assert cache.match(FP, "", toks(1, 2), lease=False).pages == 0
    assert cache.match(FP, "tenant-a", toks(1, 2), lease=False).pages == 2


def test_namespaces_do_not_share_pages(cache, ns):
    cache.register("model-b", GEO)
    put(cache, toks(1, 2))
    assert cache.match("model-b", "", toks(1, 2), lease=False).pages == 0


def test_lease_expires_at_its_ttl(cache, ns, clock):
    put(cache, toks(1, 2))
    lease = cache.match(FP, "", toks(1, 2), lease=True).lease_id
    short = cache.match(FP, "", toks(1), lease=True, ttl_s=1.0).lease_id
    clock.now = 1.0
    assert cache.expire() == 1
    with pytest.raises(NotFound):
        cache.release(short)
    clock.now = TTL - 0.001
    assert cache.expire() == 0 and cache.leases() == 1
    clock.now = TTL
    assert cache.expire() == 1
    assert cache.leases() == 0 and ns.index.locked_pages == 0
    with pytest.raises(NotFound, match="unknown or expired"):
        cache.release(lease)


# -- allocate and commit --------------------------------------------------------------------------------------------
def test_allocate_takes_free_slots_in_order(cache, ns):
    a = cache.allocate(FP, segment(cache), 3)
    b = cache.allocate(FP, segment(cache), 2)
    assert (a.slots, a.evicted, b.slots) == ((0, 1, 2), 0, (3, 4))
    assert a.allocation_id != b.allocation_id
    assert ns.allocated == {0, 1, 2, 3, 4} and ns.pool.num_free == 3


def test_commit_frees_the_slots_it_does_not_use(cache, ns):
    allocation = cache.allocate(FP, segment(cache), 4)
    assert cache.commit(FP, "", toks(1, 2), 0, allocation.slots[:2], allocation.allocation_id) == Commit(2, 0)
    assert ns.allocated == set() and ns.pool.num_free == SLOTS - 2
    assert cache.match(FP, "", toks(1, 2), lease=False).l2_slots == (0, 1)


def test_commit_ends_the_allocation(cache, ns):
    allocation = cache.allocate(FP, segment(cache), 2)
    cache.commit(FP, "", toks(1), 0, allocation.slots[:1], allocation.allocation_id)
    with pytest.raises(NotFound, match="unknown, expired"):
        cache.commit(FP, "", toks(1, 2), 1, allocation.slots[1:], allocation.allocation_id)


def test_commit_continues_a_cached_prefix(cache, ns):
    assert put(cache, toks(1, 2)) == (0, 1)
    assert put(cache, toks(1, 2, 3, 4, tail=1), first_page=2) == (2, 3)
    assert cache.match(FP, "", toks(1, 2, 3, 4), lease=False) == Match(4, (0, 1, 2, 3), None, 0, (1, 1, 1, 1))


def test_commit_branching_off_inside_a_cached_edge(cache, ns):
    put(cache, toks(1, 2, 3))
    assert put(cache, toks(1, 2, 7), first_page=2) == (3,)
    assert cache.match(FP, "", toks(1, 2, 7), lease=False).l2_slots == (0, 1, 3)
    assert cache.match(FP, "", toks(1, 2, 3), lease=False).l2_slots == (0, 1, 2)


def test_commit_after_its_prefix_was_evicted_inserts_nothing(cache, ns):
    put(cache, toks(1, 2))  # slots 0, 1
    tail = cache.allocate(FP, segment(cache), 2)  # slots 2, 3: pages 2-3 of the same prompt, written by a worker
    assert cache.allocate(FP, segment(cache), 6).evicted == 2  # needs 2 of the prefix's slots
    assert cache.commit(FP, "", toks(1, 2, 3, 4), 2, tail.slots, tail.allocation_id) == Commit(0, 0)
    assert ns.index.total_pages == 0
    assert ns.pool.num_free == 2 and ns.allocated == set(range(SLOTS)) - set(tail.slots)
    assert cache.match(FP, "", toks(1, 2, 3, 4), lease=False).pages == 0


def test_commit_after_part_of_its_prefix_was_evicted_inserts_nothing(cache, ns):
    put(cache, toks(1, 2))  # slots 0, 1
    tail = cache.allocate(FP, segment(cache), 1)  # slot 2
    assert cache.allocate(FP, segment(cache), 6).evicted == 1  # page 1 goes, page 0 stays
    assert cache.match(FP, "", toks(1, 2), lease=False) == Match(1, (0,), None, 0, (1,))
    assert cache.commit(FP, "", toks(1, 2, 3), 2, tail.slots, tail.allocation_id) == Commit(0, 0)
    assert ns.index.total_pages == 1 and ns.pool.num_free == 1


def test_commit_of_pages_another_writer_cached_first(cache, ns):
    a, b = cache.allocate(FP, segment(cache), 3), cache.allocate(FP, segment(cache), 4)  # two workers computed the same prompt
    assert cache.commit(FP, "", toks(1, 2, 3), 0, a.slots, a.allocation_id) == Commit(3, 0)
    assert cache.commit(FP, "", toks(1, 2, 3, 4), 0, b.slots, b.allocation_id) == Commit(1, 3)
    assert cache.match(FP, "", toks(1, 2, 3, 4), lease=False) == Match(4, (0, 1, 2, 6), None, 0, (1, 1, 1, 1))
    assert ns.allocated == set() and ns.pool.num_free == SLOTS - 4


def test_commit_continuation_of_pages_already_cached(cache, ns):
    put(cache, toks(1, 2, 3, 4))
    late = cache.allocate(FP, segment(cache), 2)
    assert cache.commit(FP, "", toks(1, 2, 3, 4), 2, late.slots, late.allocation_id) == Commit(0, 2)
    assert cache.match(FP, "", toks(1, 2, 3, 4), lease=False).l2_slots == (0, 1, 2, 3)
    assert ns.pool.num_free == SLOTS - 4


def test_commit_of_no_pages_returns_the_allocation(cache, ns):
    allocation = cache.allocate(FP, segment(cache), 3)
    assert cache.commit(FP, "", toks(tail=3), 0, [], allocation.allocation_id) == Commit(0, 0)
    assert ns.pool.num_free == SLOTS and ns.allocated == set()


@pytest.mark.parametrize("token_ids, first_page, slots, message", [
    (toks(1, 2), 0, [1, 4], r"slots \[4\] are not this allocation's"),  # 4 is the other allocation's
    (toks(1, 2), 0, [1, 0], r"slots \[0\] are not this allocation's"),  # 0 holds a cached page
    (toks(1, 2), 0, [1, 99], r"slots \[99\] are not this allocation's"),
    (toks(1, 2), 0, [1, 1], r"slots \[1, 1\] are not this allocation's, or repeat"),
    (toks(1, 2), 0, [1, 2, 3], r"pages \[0, 3\) exceed the 2 full pages"),
    (toks(1, 2, tail=3), 1, [1, 2], r"pages \[1, 3\) exceed the 2 full pages"),
    (toks(1, 2), 3, [], r"pages \[3, 3\) exceed the 2 full pages"),
    (toks(1, 2), -1, [1], "first_page"),
    ([1, 2, 3, -4], 0, [1], "token_ids"),
    ([1, 2, 3, 2**32], 0, [1], "token_ids"),
])
def test_bad_commit_is_invalid_and_changes_nothing(cache, ns, token_ids, first_page, slots, message):
    put(cache, toks(1))  # slot 0
    allocation, other = cache.allocate(FP, segment(cache), 3), cache.allocate(FP, segment(cache), 1)
    assert (allocation.slots, other.slots) == ((1, 2, 3), (4,))
    before = state(cache)
    with pytest.raises(InvalidRequest, match=message):
        cache.commit(FP, "", token_ids, first_page, slots, allocation.allocation_id)
    assert state(cache) == before
    # The allocation is intact: a correct commit still goes through.
    assert cache.commit(FP, "", toks(1, 2), 1, allocation.slots[:1], allocation.allocation_id) == Commit(1, 0)


@pytest.mark.parametrize("which", ["unknown", "committed", "lease", "other namespace"])
def test_commit_of_an_allocation_that_is_not_live_is_not_found(cache, ns, which):
    put(cache, toks(1))
    cache.register("model-b", GEO)
    allocation = cache.allocate(FP, segment(cache), 1)
    allocation_id = {
        "unknown": "ffff-00000000",
        "committed": allocation.allocation_id,
        "lease": cache.match(FP, "", toks(1), lease=True).lease_id,
        "other namespace": cache.allocate("model-b", segment(cache, "model-b"), 1).allocation_id,
    }[which]
    if which == "committed":
        cache.commit(FP, "", toks(2), 0, allocation.slots, allocation.allocation_id)
    before = state(cache)
    with pytest.raises(NotFound, match="unknown, expired, or of another namespace"):
        cache.commit(FP, "", toks(2), 0, allocation.slots, allocation_id)
    assert state(cache) == before


def test_allocation_expires_at_its_ttl(cache, ns, clock):
    allocation = cache.allocate(FP, segment(cache), 3)
    clock.now = TTL - 0.001
    assert cache.expire() == 0 and ns.allocated == {0, 1, 2}
    clock.now = TTL
    assert cache.expire() == 1
    assert ns.allocated == set() and ns.pool.num_free == SLOTS
    with pytest.raises(NotFound, match="unknown, expired"):
        cache.commit(FP, "", toks(1, 2, 3), 0, allocation.slots, allocation.allocation_id)
    assert ns.index.total_pages == 0


def test_expiry_drops_only_what_is_due(cache, ns, clock):
    put(cache, toks(1))
    old = cache.allocate(FP, segment(cache), 1)
    clock.now = 5.0
    new = cache.allocate(FP, segment(cache), 1)
    lease = cache.match(FP, "", toks(1), lease=True).lease_id
    clock.now = TTL
    assert cache.expire() == 1
    assert ns.allocated == set(new.slots)
    with pytest.raises(NotFound):
        cache.commit(FP, "", toks(2), 0, old.slots, old.allocation_id)
    cache.release(lease)
    assert cache.commit(FP, "", toks(2), 0, new.slots, new.allocation_id) == Commit(1, 0)


def test_allocate_negative_count_is_invalid(cache, ns):
    with pytest.raises(InvalidRequest, match="count"):
        cache.allocate(FP, segment(cache), -1)
    assert state(cache) == [(FP, SLOTS, frozenset(), 0, 0)]


# -- a full pool and eviction ---------------------------------------------------------------------------------------
def test_full_pool_with_everything_leased_allocates_nothing(cache, ns):
    put(cache, toks(1, 2, 3, 4))
    put(cache, toks(5, 6, 7, 8))
    leases = [cache.match(FP, "", toks(p), lease=True).lease_id for p in (1, 5)]
    allocation = cache.allocate(FP, segment(cache), 3)
    assert (allocation.slots, allocation.evicted) == ((), 0)
    assert cache.commit(FP, "", toks(9), 0, [], allocation.allocation_id) == Commit(0, 0)
    assert ns.index.total_pages == SLOTS
    for lease in leases:
        cache.release(lease)


def test_full_pool_with_some_leased_allocates_fewer(cache, ns):
    put(cache, toks(1, 2, 3))  # 0, 1, 2
    put(cache, toks(5, 6, 7))  # 3, 4, 5
    lease = cache.match(FP, "", toks(1), lease=True).lease_id  # pins all of (1, 2, 3): one edge
    allocation = cache.allocate(FP, segment(cache), 7)
    assert allocation.evicted == 3
    assert allocation.slots == (3, 4, 5, 6, 7)  # 7, 6 free, then 5, 4, 3 evicted (far end first)
    assert cache.match(FP, "", toks(1, 2, 3), lease=False).pages == 3
    assert cache.match(FP, "", toks(5), lease=False).pages == 0
    cache.release(lease)


def test_allocation_evicts_least_recently_used_first(cache, ns):
    put(cache, toks(1, 2))  # A: 0, 1
    put(cache, toks(3, 4))  # B: 2, 3
    put(cache, toks(5, 6))  # C: 4, 5; slots 6, 7 stay free
    cache.match(FP, "", toks(1), lease=False)  # A is now the most recent: LRU order is B, C, A
    allocation = cache.allocate(FP, segment(cache), 5)  # 2 free + 3 evicted: B's 2 pages, then C's far page
    assert allocation.evicted == 3
    assert allocation.slots == (5, 2, 3, 6, 7)  # not in eviction order: free() extends, allocate pops
    assert cache.match(FP, "", toks(1, 2), lease=False).l2_slots == (0, 1)
    assert cache.match(FP, "", toks(3), lease=False).pages == 0
    assert cache.match(FP, "", toks(5, 6), lease=False).l2_slots == (4,)


def test_eviction_spares_a_shared_prefix_until_its_branches_go(cache, ns):
    put(cache, toks(1, 2, 3))  # 0, 1, 2
    put(cache, toks(1, 2, 7), first_page=2)  # 3
    put(cache, toks(9, 9))  # 4, 5
    cache.match(FP, "", toks(9, 9), lease=False)  # LRU: branch (3), branch (7), then (9, 9)
    assert cache.allocate(FP, segment(cache), 4).evicted == 2  # 2 free (6, 7) + the two branch pages
    assert cache.match(FP, "", toks(1, 2, 3), lease=False).l2_slots == (0, 1)
    assert cache.match(FP, "", toks(9, 9), lease=False).pages == 2


def test_allocation_larger_than_needed_evicts_only_the_shortfall(cache, ns):
    put(cache, toks(1, 2, 3))
    assert cache.allocate(FP, segment(cache), 5).evicted == 0
    assert cache.allocate(FP, segment(cache), 1).evicted == 1
    assert cache.match(FP, "", toks(1, 2, 3), lease=False).pages == 2


def test_leased_pages_survive_eviction_until_the_lease_expires(cache, ns, clock):
    put(cache, toks(1, 2, 3, 4, 5, 6, 7, 8))  # one edge in slots 0..7
    cache.match(FP, "", toks(1), lease=True)  # pins the whole edge
    assert cache.allocate(FP, segment(cache), 1)[1:] == ((), 0)
    clock.now = TTL
    assert cache.expire() == 2  # the lease and the empty allocation
    assert cache.allocate(FP, segment(cache), 2)[1:] == ((6, 7), 2)  # pages 8 and 7 went
    assert cache.match(FP, "", toks(1, 2, 3, 4, 5, 6, 7, 8), lease=False).pages == 6


# -- slot headers, segments and caps --------------------------------------------------------------------------------

def test_a_committed_slot_names_its_block_and_a_reallocated_one_changes_generation(cache, ns):
    slots = put(cache, toks(1, 2))
    hashes = block_hashes(namespace_key(FP, ""), toks(1, 2), PAGE)
    assert [ns.pool.segment.header(s) for s in slots] == [(1, hashes[0]), (1, hashes[1])]
    assert cache.allocate(FP, segment(cache), SLOTS - 2).slots == (2, 3, 4, 5, 6, 7)
    again = cache.allocate(FP, segment(cache), 1)  # evicts page 2 (slot 1) and hands its slot out again
    assert again.slots == (1,) and ns.pool.segment.header(1) == (2, EMPTY_KEY)
    assert ns.pool.segment.header(0) == (1, hashes[0])  # untouched


def test_allocate_in_another_segment_is_a_conflict(cache, ns):
    with pytest.raises(Conflict, match="register again"):
        cache.allocate(FP, "radixserve_1_deadbeef", 1)
    assert cache.allocations() == 0


def test_caps_on_allocation_size_and_ttl(cache, ns):
    with pytest.raises(InvalidRequest, match=r"\[0, 1024\] \(--max-allocation-slots\), got 1025"):
        cache.allocate(FP, segment(cache), 1025)
    with pytest.raises(InvalidRequest, match=r"exceeds the cap of 300 s \(--max-lease-ttl-s\)"):
        cache.match(FP, "", toks(1), lease=True, ttl_s=301)
    with pytest.raises(InvalidRequest, match="--max-lease-ttl-s"):
        cache.allocate(FP, segment(cache), 1, ttl_s=4e6)
    assert (cache.leases(), cache.allocations()) == (0, 0)
