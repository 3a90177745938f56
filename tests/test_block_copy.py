"""Block moves between the L1 pool and shared memory: the CPU path exactly, the CUDA path where there is a GPU."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from kvcached.tiers.dram_shm import SlabPool
from model_worker.block_copy import CudaBlockCopy, HostBlockCopy, block_copy_for, slab_blocks
from model_worker.kv_pool import KVPool
from radixserve.blocks.geometry import BlockGeometry
from radixserve.blocks.slab import new_segment_name

GEOMETRY = BlockGeometry(num_layers=2, num_kv_heads=1, head_dim=2, page_size=4, dtype="bfloat16")
SHAPE = GEOMETRY.block_shape


@contextmanager
def slab_pool(slots: int) -> Iterator[SlabPool]:
    pool = SlabPool.create(new_segment_name(), GEOMETRY.block_bytes, slots)
    try:
        yield pool
    finally:
        pool.close()
        pool.unlink()


@pytest.fixture
def shm():
    with slab_pool(3) as pool:
        yield pool


def blocks_of(shm: SlabPool) -> torch.Tensor:
    blocks = slab_blocks(shm.segment, GEOMETRY)
    assert blocks.shape == (3, *SHAPE)
    return blocks


def test_cpu_pool_gets_the_memmove_copy():
    assert type(block_copy_for(torch.device("cpu"))) is HostBlockCopy


def test_host_copy_moves_one_block_exactly_both_ways(shm):
    shm_blocks = blocks_of(shm)
    pool = KVPool(4, GEOMETRY)
    copy = block_copy_for(pool.kv.device)
    shm_blocks[1] = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.bfloat16).view(SHAPE)
    copy.copy(pool.kv[2], shm_blocks[1])
    copy.drain()
    assert torch.equal(pool.kv[2], shm_blocks[1]) and not pool.kv[1].any() and not pool.kv[3].any()
    copy.copy(shm_blocks[0], pool.kv[2])
    copy.drain()
    assert torch.equal(shm_blocks[0], shm_blocks[1]) and not shm_blocks[2].any()


def test_copies_shared_with_the_helper_land_exactly():
    """The L2 -> L1 copier drains with a helper thread, the two taking blocks in turn: each of 16 blocks lands in
    its own page, nothing is written before the drain, and the other pages stay untouched."""
    with slab_pool(16) as shm:
        blocks = slab_blocks(shm.segment, GEOMETRY)
        blocks.copy_(torch.randn(blocks.shape).to(blocks.dtype))
        pool = KVPool(40, GEOMETRY)
        copy = block_copy_for(pool.kv.device, waited_for=True)
        pages = list(range(39, 7, -2))  # 16 pages, every other one, in reverse
        for page, slot in zip(pages, range(16)):
            copy.copy(pool.kv[page], blocks[slot])
        assert not pool.kv.any()
        copy.drain()
        assert all(torch.equal(pool.kv[page], blocks[slot]) for page, slot in zip(pages, range(16)))
        assert not pool.kv[[p for p in range(40) if p not in pages]].any()
        del blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copy_from_pinned_shared_memory_is_exact(shm):
    shm_blocks = blocks_of(shm)
    pool = KVPool(4, GEOMETRY, device="cuda")
    copy = block_copy_for(pool.kv.device)
    assert isinstance(copy, CudaBlockCopy)
    copy.pin(shm_blocks)
    shm_blocks[1] = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.bfloat16).view(SHAPE)
    copy.copy(pool.kv[2], shm_blocks[1])
    copy.drain()
    assert torch.equal(pool.kv[2].cpu(), shm_blocks[1])
    copy.copy(shm_blocks[0], pool.kv[2])
    copy.drain()
    assert torch.equal(shm_blocks[0], shm_blocks[1])
    copy.unpin(shm_blocks)
