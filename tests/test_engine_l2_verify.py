"""The worker's check of a leased L2 page before it joins L1, in process: a real kvcached slab pool in shared memory
(headers written by its owner side, as the daemon does), the worker's PrefixCache, page size 4.

The kvcached link is a stand-in that hands out the attached segment and records releases: what is under test is
the worker's verification, not the RPCs (those run through real processes in tests/test_e2e_integrity.py).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvcached.tiers.dram_shm import SlabPool
from model_worker.block_copy import HostBlockCopy, slab_blocks
from model_worker.kv_pool import KVPool
from model_worker.kvcache_client import Attached
from model_worker.prefix_cache import CacheRequest, CacheState, L2Lease, PrefixCache
from radixserve.blocks.geometry import BlockGeometry
from radixserve.blocks.keys import block_hashes, namespace_key
from radixserve.blocks.slab import SlabSegment, new_segment_name

GEOMETRY = BlockGeometry(num_layers=2, num_kv_heads=1, head_dim=2, page_size=4, dtype="float32")
FP = "model-a"
PROMPT = list(range(100, 117))  # 17 tokens: 4 full pages, all usable (reuse stops one token short)
SLOTS = (5, 2, 7, 0)


class LinkStandIn:
    """What PrefixCache asks of the kvcached client: the registered segment, and lease releases."""

    def __init__(self, attached: Attached):
        self.attached = attached
        self.released: list[str] = []

    def l2_segment(self, segment_name: str) -> Attached | None:
        return self.attached if segment_name == self.attached.segment.name else None

    def release(self, lease_id: str) -> None:
        self.released.append(lease_id)


@pytest.fixture
def l2():
    """kvcached's pool with PROMPT's pages committed into SLOTS (bytes: page i is filled with i + 1)."""
    pool = SlabPool.create(new_segment_name(), GEOMETRY.block_bytes, 8)
    pool.allocate(8)
    blocks = slab_blocks(pool.segment, GEOMETRY)
    for page, (slot, key) in enumerate(zip(SLOTS, hashes(""))):
        blocks[slot] = page + 1.0
        pool.set_key(slot, key)
    del blocks
    yield pool
    pool.unlink()
    pool.close()


@pytest.fixture
def worker(l2):
    segment = SlabSegment.attach(l2.name, GEOMETRY.block_bytes, 8)
    link = LinkStandIn(Attached(segment, slab_blocks(segment, GEOMETRY)))
    kv = KVPool(16, GEOMETRY)
    cache = PrefixCache(kv, FP, link, threading.RLock(), HostBlockCopy())
    yield cache, kv, link
    link.attached.blocks = None
    segment.close()


def hashes(salt: str) -> list:
    return block_hashes(namespace_key(FP, salt), PROMPT[:16], GEOMETRY.page_size)


def lease(pool: SlabPool, **change) -> L2Lease:
    fields = dict(lease_id="lease-1", segment_name=pool.name, slots=SLOTS,
                  generations=tuple(pool.generation(s) for s in SLOTS), expires_unix_ms=int(time.time() * 1e3) + 30_000)
    return L2Lease(**{**fields, **change})


def attach(cache: PrefixCache, l2_lease: L2Lease, salt: str = "") -> tuple[int, CacheState]:
    state = CacheState(CacheRequest(salt=salt, l2_lease=l2_lease))
    return cache.attach("r", PROMPT, state), state


def copied_pages(kv: KVPool, n: int) -> list[float]:
    return [float(kv.kv[page].mean()) for page in kv.block_table("r")[:n]]


def rejected(reason: str) -> float:
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value("radixserve_worker_l2_pages_rejected_total", {"reason": reason}) or 0.0


def test_a_live_lease_of_verified_slots_is_copied_in_full(worker, l2):
    cache, kv, link = worker
    reused, state = attach(cache, lease(l2))
    assert reused == 16 and state.cached_l2_tokens == 16
    assert copied_pages(kv, 4) == [1.0, 2.0, 3.0, 4.0]
    assert link.released == ["lease-1"]


@pytest.mark.parametrize("change, reason", [
    (dict(segment_name="radixserve_1_deadbeef"), "segment"),
    (dict(slots=(5, 2, 7, 99)), "out_of_range"),
    (dict(expires_unix_ms=1), "expired"),
])
def test_a_lease_that_cannot_be_used_reuses_nothing_and_is_released(worker, l2, change, reason):
    cache, kv, link = worker
    before = rejected(reason)
    reused, state = attach(cache, lease(l2, **change))
    assert reused == 0 and state.pages_in_l2 == 0
    assert rejected(reason) - before == 4
    assert link.released == ["lease-1"] and kv.num_free == kv.num_pages  # nothing allocated, nothing held
    cache.detach(state)
    kv.release("r")
    cache.check_integrity()


def test_a_reallocated_slot_ends_the_prefix_there(worker, l2):
    cache, kv, link = worker
    stale = lease(l2)
    l2.free([SLOTS[2]])
    l2.allocate(1)  # kvcached hands slot 7 to another writer: a new generation, no key
    before = rejected("generation")
    reused, state = attach(cache, stale)
    assert reused == 8 and copied_pages(kv, 2) == [1.0, 2.0]
    assert rejected("generation") - before == 2
    cache.detach(state)
    kv.release("r")
    cache.check_integrity()
    assert kv.num_free == kv.num_pages  # the pages allocated for the rejected tail went back


def test_another_tenants_slots_fail_the_key_check(worker, l2):
    cache, kv, link = worker
    before = rejected("key")
    reused, _ = attach(cache, lease(l2), salt="tenant-b")  # the header keys are the unsalted tenant's
    assert reused == 0 and rejected("key") - before == 4


def test_a_generation_that_changes_during_the_copy_is_caught(worker, l2, monkeypatch):
    cache, kv, link = worker
    copy = HostBlockCopy.copy

    def copy_then_reallocate(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        copy(self, dst, src)
        if len(link_copies) == 1:  # while the worker copies page 1, kvcached reallocates slot 2
            l2.free([SLOTS[1]])
            l2.allocate(1)
        link_copies.append(1)

    link_copies: list[int] = []
    monkeypatch.setattr(HostBlockCopy, "copy", copy_then_reallocate)
    reused, _ = attach(cache, lease(l2))
    assert reused == 4 and copied_pages(kv, 1) == [1.0]
