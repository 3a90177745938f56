import pytest
import torch

from model_worker.kv_pool import KVPool, OutOfPages, pages_for_budget, pages_for_tokens
from radixserve.blocks.geometry import BlockGeometry


def make_pool(num_pages: int = 6) -> KVPool:
    return KVPool(num_pages, BlockGeometry(num_layers=2, num_kv_heads=2, head_dim=3, page_size=4, dtype="float32"))


def test_allocate_free_exact_ids_and_fifo_reuse():
    pool = make_pool()
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    pool.decref([1, 3])
    assert pool.num_free == 3
    assert pool.allocate(3) == [5, 1, 3]
    pool.check_integrity()


def test_allocate_too_many_changes_nothing():
    pool = make_pool()
    pool.allocate(5)
    with pytest.raises(OutOfPages):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.check_integrity()


def test_refcount_shared_page_freed_by_last_holder():
    pool = make_pool()
    pool.ensure_capacity("a", 6)  # 2 pages
    shared = pool.block_table("a")[:1]
    pool.incref(shared)
    assert pool.refcount(0) == 2
    pool.release("a")
    assert pool.refcount(0) == 1 and pool.refcount(1) == 0
    assert pool.num_free == 5
    pool.decref(shared)
    assert pool.num_free == 6
    with pytest.raises(ValueError):
        pool.decref(shared)
    with pytest.raises(ValueError):
        pool.incref([3])
    pool.check_integrity()


def test_block_tables_grow_page_by_page():
    pool = make_pool()
    pool.ensure_capacity("a", 1)
    pool.ensure_capacity("b", 5)
    pool.ensure_capacity("a", 4)
    assert pool.block_table("a") == [0]
    pool.ensure_capacity("a", 5)
    assert pool.block_table("a") == [0, 3]
    assert pool.block_table("b") == [1, 2]
    with pytest.raises(OutOfPages):
        pool.ensure_capacity("b", 4 * 6)
    assert pool.block_table("b") == [1, 2]
    pool.release("a")
    pool.release("b")
    pool.release("unknown")
    assert pool.num_free == 6
    pool.check_integrity()


def test_write_lands_in_page_first_layout_and_page_view_is_contiguous():
    pool = make_pool()
    k = torch.arange(2 * 2 * 3, dtype=torch.float32).view(2, 2, 3)
    pool.write(1, torch.tensor([4, 2]), torch.tensor([3, 0]), k, -k)
    assert torch.equal(pool.kv[4, 1, 0, 3], k[0])
    assert torch.equal(pool.kv[2, 1, 1, 0], -k[1])
    view = pool.page_view(4)
    assert view.is_contiguous() and view.shape == (2, 2, 4, 2, 3)
    assert view.data_ptr() == pool.kv.data_ptr() + 4 * view.numel() * 4
    assert pool.kv.abs().sum() == 2 * k.abs().sum()


def test_sizes():
    assert [pages_for_tokens(n, 4) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]
    # SmolLM2 in bfloat16: 368 KiB per 16-token page (docs/design.md)
    assert pages_for_budget(368 * 1024 * 10 / (1 << 30), BlockGeometry(30, 3, 64, 16, "bfloat16")) == 10
    with pytest.raises(ValueError):
        KVPool(0, BlockGeometry(1, 1, 1, 4, "float32"))

