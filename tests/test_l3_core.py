"""The disk tier inside KVCache: write policies, L3 runs in matches, prefetch bookkeeping, stale namespaces.

A real DiskTier (LMDB in tmp_path) and real shared memory; blocks of 256 bytes, pages of 4 tokens, 8 L2 slots.
"""

from __future__ import annotations

import threading

import pytest
from prometheus_client import REGISTRY

from kvcached.__main__ import check_idle
from kvcached.cache import KVCache
from kvcached.l3 import L3, WritePolicy
from kvcached.tiers.lmdb_tier import ROOT_PARENT, DiskTier
from radixserve.blocks.keys import BlockHash
from radixserve.blocks.slab import EMPTY_KEY
from tests.kvcache_helpers import BLOCK, FP, GEO, PAGE, SLOTS, TTL, Checked, FakeClock, segment, toks


@pytest.fixture
def disk(tmp_path):
    with DiskTier(tmp_path / "l3", 1 << 20) as tier:
        yield tier


def make_cache(disk: DiskTier, policy: WritePolicy) -> Checked:
    cache = KVCache(SLOTS * BLOCK, PAGE, TTL, FakeClock(), l3=L3(disk, policy))
    cache.register(FP, GEO)
    return Checked(cache)


@pytest.fixture
def close_all():
    caches: list[Checked] = []
    yield caches.append
    for cache in caches:
        cache.raw.close()


def commit(cache: Checked, tokens: list[int], first_page: int = 0) -> None:
    pages = len(tokens) // PAGE - first_page
    allocation = cache.allocate(FP, segment(cache), pages)
    for i, slot in enumerate(allocation.slots):  # distinct bytes per page, to check what L3 gets
        cache.namespace(FP).pool.view(slot)[:] = bytes([first_page + i + 1]) * BLOCK
    cache.commit(FP, "", tokens, first_page, allocation.slots, allocation.allocation_id)


def stored(cache: Checked, disk: DiskTier) -> int:
    disk.flush()
    cache.l3.refresh()
    return disk.stats().blocks


def test_write_through_stores_every_committed_block(disk, close_all):
    cache = make_cache(disk, WritePolicy.WRITE_THROUGH)
    close_all(cache)
    commit(cache, toks(1, 2, 3))
    assert stored(cache, disk) == 3
    commit(cache, toks(1, 2, 3, 4), first_page=3)
    assert stored(cache, disk) == 4


def test_selective_stores_a_block_on_its_second_hit(disk, close_all):
    cache = make_cache(disk, WritePolicy.WRITE_THROUGH_SELECTIVE)
    close_all(cache)
    commit(cache, toks(1, 2))
    cache.match(FP, "", toks(1), lease=False)
    assert stored(cache, disk) == 0
    cache.match(FP, "", toks(1, 2), lease=False)
    assert stored(cache, disk) == 1  # page 1 hit twice, page 2 once
    cache.match(FP, "", toks(1, 2), lease=False)
    assert stored(cache, disk) == 2


def test_write_back_stores_only_what_l2_evicts_with_its_bytes(disk, close_all):
    cache = make_cache(disk, WritePolicy.WRITE_BACK)
    close_all(cache)
    commit(cache, toks(1, 2, 3, 4, 5, 6))
    assert stored(cache, disk) == 0
    cache.allocate(FP, segment(cache), 4)  # 2 free: evicts pages 6 and 5, leaf end first
    assert stored(cache, disk) == 2
    match = cache.match(FP, "", toks(1, 2, 3, 4, 5, 6), lease=False)
    assert (match.pages, match.l3_pages) == (4, 2)
    hashes = cache._hashes(cache.namespace(FP), "", toks(1, 2, 3, 4, 5, 6))
    assert disk.get(hashes[5]) == bytes([6]) * BLOCK


class GatedSource:
    """A queued block whose copy waits for `gate`: it holds the disk writer, so the test can act before the writer
    reaches the blocks queued after it."""

    nbytes = BLOCK

    def __init__(self) -> None:
        self.gate = threading.Event()

    def copy_into(self, out: memoryview) -> bool:
        assert self.gate.wait(10)
        out[:] = bytes(BLOCK)
        return True


def test_write_through_copies_a_slot_when_it_writes_it_or_when_l2_evicts_it_first(disk, close_all):
    cache = make_cache(disk, WritePolicy.WRITE_THROUGH)
    close_all(cache)
    held = GatedSource()
    assert disk.put_async(FP, BlockHash(bytes(range(16))), ROOT_PARENT, held)
    try:
        commit(cache, toks(1, 2, 3))  # queued behind the held block, not copied yet
        pool = cache.namespace(FP).pool
        hashes = cache._hashes(cache.namespace(FP), "", toks(1, 2, 3))
        page_2 = next(slot for slot in range(SLOTS) if pool.segment.header(slot).key == hashes[1])
        pool.set_key(page_2, bytes(range(16)))  # as if page 2's slot had been rewritten behind the index's back
        reused = cache.allocate(FP, segment(cache), SLOTS - 2)  # 5 free: evicts page 3, the leaf end, reuses its slot
        for slot in reused.slots:
            pool.view(slot)[:] = b"\xee" * BLOCK
    finally:  # a failure above must not leave the writer held
        held.gate.set()
    # page 3 was copied out at its eviction; page 2's slot no longer vouches for it: dropped, never a wrong block
    assert stored(cache, disk) == 3 and disk.stats().dropped_writes == 1
    assert [disk.get(h) for h in hashes] == [bytes([1]) * BLOCK, None, bytes([3]) * BLOCK]
    assert cache.l3.run_length(hashes, 0) == 1 and cache.l3.run_length(hashes, 2) == 1


def test_only_a_block_that_leaves_l2_before_the_writer_reaches_it_urges_the_writer(disk, close_all, monkeypatch):
    urges = []
    monkeypatch.setattr(disk, "urge", lambda: urges.append(1))
    cache = make_cache(disk, WritePolicy.WRITE_THROUGH)
    close_all(cache)
    commit(cache, toks(1, 2, 3))
    assert stored(cache, disk) == 3
    held = GatedSource()
    assert disk.put_async(FP, BlockHash(bytes(range(16))), ROOT_PARENT, held)
    try:
        commit(cache, toks(4, 5))  # queued behind the held block
        cache.allocate(FP, segment(cache), SLOTS - 2)  # 3 free: evicts the 3 older pages, already on disk
        assert not urges
        cache.allocate(FP, segment(cache), 2)  # evicts the queued two: their bytes now wait in memory
        assert urges == [1]
    finally:
        held.gate.set()
    assert stored(cache, disk) == 6


def test_a_slot_whose_header_does_not_name_the_block_never_reaches_l3(disk, close_all):
    cache = make_cache(disk, WritePolicy.WRITE_BACK)
    close_all(cache)
    commit(cache, toks(1, 2))
    pool = cache.namespace(FP).pool
    pool.set_key(1, bytes(range(16)))  # as if slot 1 had been rewritten behind the index's back
    cache.allocate(FP, segment(cache), SLOTS)  # evicts both pages: write-back stores what it can vouch for
    assert stored(cache, disk) == 1 and cache.l3.unverified_blocks == 1


def test_a_block_whose_write_was_dropped_is_never_matched_in_l3(tmp_path, close_all):
    with DiskTier(tmp_path / "l3", BLOCK // 2) as tiny:  # every block is larger than the budget: each write drops
        cache = make_cache(tiny, WritePolicy.WRITE_THROUGH)
        close_all(cache)
        commit(cache, toks(1, 2, 3))
        assert stored(cache, tiny) == 0 and tiny.stats().dropped_writes == 3
        cache.allocate(FP, segment(cache), SLOTS)  # evicts the three pages from L2
        assert cache.match(FP, "", toks(1, 2, 3), lease=False).l3_pages == 0


def test_prefetch_loads_the_l3_run_front_to_back_into_l2(disk, close_all):
    cache = make_cache(disk, WritePolicy.WRITE_BACK)
    close_all(cache)
    prompt = toks(1, 2, 3, 4, 5, 6)
    commit(cache, prompt)
    cache.allocate(FP, segment(cache), 5)  # evicts pages 6, 5, 4 to L3
    assert stored(cache, disk) == 3
    match = cache.match(FP, "", prompt, lease=False)
    assert (match.pages, match.l3_pages) == (3, 3)
    cache.raw._clock.now += 2 * TTL  # drop the allocations above so the prefetch gets slots
    cache.raw.expire()
    prefetch = cache.start_prefetch(FP, "", prompt, match)
    assert prefetch.total == 3 and cache.start_prefetch(FP, "", prompt, match) is prefetch
    hashes = prefetch.hashes
    for page in range(3, 6):
        slot = prefetch.slots[page - 3]
        assert disk.read_into(hashes[page], cache.namespace(FP).pool.view(slot))
        assert cache.namespace(FP).pool.segment.header(slot).key == EMPTY_KEY  # bytes in, not yet vouched for
        assert cache.prefetched(prefetch)
        assert cache.namespace(FP).pool.segment.header(slot).key == hashes[page]
        assert cache.match(FP, "", prompt, lease=False).pages == page + 1
    cache.end_prefetch(prefetch)
    assert prefetch.done and cache.prefetch(prefetch.prefetch_id) is None


def test_end_prefetch_frees_unloaded_slots_but_keeps_a_stuck_one(disk, close_all):
    cache = make_cache(disk, WritePolicy.WRITE_BACK)
    close_all(cache)
    prompt = toks(1, 2, 3, 4, 5, 6)
    commit(cache, prompt)
    cache.allocate(FP, segment(cache), 6)
    cache.raw._clock.now += 2 * TTL
    cache.raw.expire()
    match = cache.match(FP, "", prompt, lease=False)
    prefetch = cache.start_prefetch(FP, "", prompt, match)
    stuck = prefetch.slots[0]
    free_before = cache.namespace(FP).pool.num_free
    cache.end_prefetch(prefetch, keep=[stuck])
    assert cache.namespace(FP).pool.num_free == free_before + prefetch.total - 1
    cache.free_slot(cache.namespace(FP), stuck)
    assert cache.namespace(FP).pool.num_free == free_before + prefetch.total


def test_blocks_of_another_model_are_never_matched_and_can_be_dropped(disk, close_all):
    cache = make_cache(disk, WritePolicy.WRITE_THROUGH)
    close_all(cache)
    commit(cache, toks(1, 2, 3))
    assert stored(cache, disk) == 3
    other = KVCache(SLOTS * BLOCK, PAGE, TTL, FakeClock(), l3=L3(disk, WritePolicy.WRITE_THROUGH))
    close_all(Checked(other))
    other.register("model-b", GEO)
    assert other.match("model-b", "", toks(1, 2, 3), lease=False).l3_pages == 0
    assert disk.delete_namespace(FP) == 3
    other.l3.refresh()
    assert len(other.l3) == 0


def integrity_failures() -> float:
    return REGISTRY.get_sample_value("radixserve_kvcached_integrity_failures_total")


def test_idle_check_counts_and_logs_a_broken_invariant(disk, close_all, caplog):
    cache = make_cache(disk, WritePolicy.WRITE_THROUGH).raw
    close_all(Checked(cache))
    before = integrity_failures()
    check_idle(cache)
    assert integrity_failures() == before
    cache.namespace(FP).allocated.add(0)  # a slot no allocation owns
    check_idle(cache)
    assert integrity_failures() == before + 1
    assert "integrity check failed" in caplog.text
    cache.namespace(FP).allocated.discard(0)
