"""Block moves between the L1 pool and shared memory: the CPU path exactly, the CUDA path where there is a GPU."""

from __future__ import annotations

import pytest
import torch

from kvcached.tiers.dram_shm import SlabPool, new_segment_name
from model_worker.block_copy import CudaBlockCopy, HostBlockCopy, block_copy_for
from model_worker.kv_pool import KVPool

SHAPE = (2, 2, 4, 1, 2)  # layers, K/V, page, kv heads, head dim


@pytest.fixture
def shm():
    pool = SlabPool.create(new_segment_name(), torch.Size(SHAPE).numel() * 2, 3)
    yield pool
    pool.close()
    pool.unlink()


def blocks_of(shm: SlabPool) -> torch.Tensor:
    return torch.frombuffer(shm.buffer, dtype=torch.bfloat16).view(3, *SHAPE)


def test_cpu_pool_gets_the_memmove_copy():
    assert type(block_copy_for(torch.device("cpu"))) is HostBlockCopy


def test_host_copy_moves_one_block_exactly_both_ways(shm):
    shm_blocks = blocks_of(shm)
    pool = KVPool(4, *SHAPE[:1], SHAPE[2], SHAPE[3], SHAPE[4], torch.bfloat16)
    copy = block_copy_for(pool.kv.device)
    shm_blocks[1] = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.bfloat16).view(SHAPE)
    copy.copy(pool.kv[2], shm_blocks[1])
    copy.fence()
    assert torch.equal(pool.kv[2], shm_blocks[1]) and not pool.kv[1].any() and not pool.kv[3].any()
    copy.copy(shm_blocks[0], pool.kv[2])
    copy.drain()
    assert torch.equal(shm_blocks[0], shm_blocks[1]) and not shm_blocks[2].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_copy_from_pinned_shared_memory_is_exact(shm):
    shm_blocks = blocks_of(shm)
    pool = KVPool(4, *SHAPE[:1], SHAPE[2], SHAPE[3], SHAPE[4], torch.bfloat16, device="cuda")
    copy = block_copy_for(pool.kv.device)
    assert isinstance(copy, CudaBlockCopy)
    copy.pin(shm_blocks)
    shm_blocks[1] = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.bfloat16).view(SHAPE)
    copy.copy(pool.kv[2], shm_blocks[1])
    copy.fence()
    assert torch.equal(pool.kv[2].cpu(), shm_blocks[1])
    copy.copy(shm_blocks[0], pool.kv[2])
    copy.drain()
    assert torch.equal(shm_blocks[0], shm_blocks[1])
    copy.unpin(shm_blocks)
