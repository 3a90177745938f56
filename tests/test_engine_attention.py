import pytest
import torch

from model_worker.attention import Chunk, SdpaBackend, flash_metadata, select_backend
from model_worker.kv_pool import KVPool
from radixserve.blocks.geometry import BlockGeometry

HEADS, KV_HEADS, DIM, PAGE = 4, 2, 8, 4


def reference(q, k, v, start):
    """Naive causal attention of queries at positions start.. over keys 0..start+len(q)-1 (GQA by repeat)."""
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * DIM ** -0.5
    allowed = torch.arange(k.shape[0])[None, :] <= torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


# (cached prefix, new tokens) per sequence: fresh prefill, prefill after a prefix, decodes of different lengths
CASES = [[(0, 6), (5, 3), (9, 1), (2, 1)], [(3, 1), (7, 1)], [(0, 1)], [(4, 4)], [(6, 1), (6, 1)]]


@pytest.mark.parametrize("layout", CASES)
def test_sdpa_backend_matches_naive_attention(layout):
    torch.manual_seed(0)
    pool = KVPool(32, BlockGeometry(2, KV_HEADS, DIM, PAGE, "float32"))
    backend = SdpaBackend(pool, HEADS, KV_HEADS, DIM)
    chunks, full_k, full_v = [], [], []
    for i, (start, length) in enumerate(layout):
        pool.ensure_capacity(str(i), start + length)
        k, v = torch.randn(start + length, KV_HEADS, DIM), torch.randn(start + length, KV_HEADS, DIM)
        prefix = Chunk(pool.block_table(str(i)), 0, start)
        if start:
            meta = backend.prepare([prefix])
            pool.write(1, meta.write_pages, meta.write_offsets, k[:start], v[:start])
        chunks.append(Chunk(pool.block_table(str(i)), start, length))
        full_k.append(k)
        full_v.append(v)
    total = sum(c.length for c in chunks)
    q = torch.randn(total, HEADS, DIM)
    new_k = torch.cat([k[c.start:] for k, c in zip(full_k, chunks)])
    new_v = torch.cat([v[c.start:] for v, c in zip(full_v, chunks)])
    out = backend.attend(1, q, new_k, new_v, backend.prepare(chunks))
    expected = torch.cat([reference(qs, k, v, c.start) for qs, k, v, c in
                          zip(q.split([c.length for c in chunks]), full_k, full_v, chunks)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_flash_metadata():
    chunks = [Chunk([3, 5], 2, 4), Chunk([7], 0, 1), Chunk([1, 2, 9], 8, 1)]
    meta = flash_metadata(chunks, page_size=4, device="cpu")
    assert meta.write_pages.tolist() == [3, 3, 5, 5, 7, 9]
    assert meta.write_offsets.tolist() == [2, 3, 0, 1, 0, 0]
    assert meta.cu_seqlens_q.tolist() == [0, 4, 5, 6]
    assert meta.cu_seqlens_k.tolist() == [0, 6, 7, 16]
    assert meta.seqlens_k.tolist() == [6, 1, 9]
    assert (meta.max_seqlen_q, meta.max_seqlen_k, meta.decode_only) == (4, 9, False)
    assert meta.block_table.tolist() == [[3, 5, 0], [7, 0, 0], [1, 2, 9]]
    assert meta.block_table.dtype == torch.int32
    assert flash_metadata(chunks[1:], 4, "cpu").decode_only


def test_select_backend_falls_back_to_sdpa_on_cpu():
    pool = KVPool(2, BlockGeometry(1, KV_HEADS, DIM, PAGE, "float32"))
    assert isinstance(select_backend(pool, HEADS, KV_HEADS, DIM), SdpaBackend)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_backend_matches_sdpa_on_cuda():
    pytest.importorskip("flash_attn")
    from model_worker.attention import FlashAttentionBackend

    torch.manual_seed(0)
    pool = KVPool(8, BlockGeometry(1, KV_HEADS, DIM, 256, "bfloat16"), "cuda")
    pool.ensure_capacity("a", 300)
    pool.ensure_capacity("b", 1)
    chunks = [Chunk(pool.block_table("a"), 0, 300), Chunk(pool.block_table("b"), 0, 1)]
    q = torch.randn(301, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    k, v = torch.randn(2, 301, KV_HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    flash, sdpa = FlashAttentionBackend(pool, HEADS, KV_HEADS, DIM), SdpaBackend(pool, HEADS, KV_HEADS, DIM)
    out = flash.attend(0, q, k, v, flash.prepare(chunks))
    torch.testing.assert_close(out, sdpa.attend(0, q, k, v, sdpa.prepare(chunks)), atol=2e-2, rtol=2e-2)
