"""The fused CPU kernels (model_worker/cpu_kernels.py) against torch's ops, row by row and batch-independent."""

import pytest
import torch
import torch.nn.functional as F

from model_worker import cpu_kernels
from model_worker.attention import Chunk, PagedCpuBackend, SdpaBackend, select_backend
from model_worker.kv_pool import KVPool
from radixserve.blocks.geometry import BlockGeometry
from tests.engine_helpers import make_engine, prefill_logits, save_tiny_model

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the fused CPU kernels did not build here")


def ops():
    return torch.ops.radixserve


@pytest.mark.parametrize("width", [576, 61])  # 61: a partial last vector
def test_rms_norm_and_add_rms_norm_match_torch(width):
    torch.manual_seed(0)
    x, residual, weight = torch.randn(9, width), torch.randn(9, width), torch.randn(width)
    expected = F.rms_norm(x, (width,), weight, 1e-5)
    torch.testing.assert_close(ops().rms_norm(x, weight, 1e-5), expected, atol=2e-6, rtol=2e-6)
    fresh, stream = x.clone(), residual.clone()
    ops().add_rms_norm_(fresh, stream, weight, 1e-5)
    assert torch.equal(stream, x + residual)  # the residual sum is torch's, bit for bit
    torch.testing.assert_close(fresh, F.rms_norm(x + residual, (width,), weight, 1e-5), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("intermediate", [1536, 13])  # 13: each half's last panel padded
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_silu_is_silu_times_up_of_the_linear_over_the_whole_range(intermediate, bias):
    """SiLU of the gate times the up, applied to each tile of the projection: `linear`'s columns (the same FMA
    chains) through a SiLU close to float64's over the range where it saturates both ways, and bit for bit the same
    for a row alone, among a few and among 40, on AVX2 and AVX-512 alike."""
    from model_worker.model import KernelGateUpSilu

    torch.manual_seed(0)
    gate_up = KernelGateUpSilu(24, 2 * intermediate, bias=bias)
    with torch.no_grad():
        gate_up.weight.normal_(std=2.0)
        if bias:
            gate_up.bias.normal_()
    gate_up.pack()
    x = torch.randn(40, 24) * torch.linspace(0.1, 10, 40)[:, None]  # pre-activations up to ~+-100
    product = ops().linear(x, ops().pack_linear_weight(gate_up.weight), 2 * intermediate, gate_up.bias)
    gate, up = product.double().chunk(2, dim=-1)
    expected = (gate * torch.sigmoid(gate) * up).float()
    together = gate_up(x)
    torch.testing.assert_close(together, expected, atol=1e-5, rtol=2e-6)
    for rows in (1, 2, 3, 7, 9):
        assert torch.equal(gate_up(x[rows:2 * rows]), together[rows:2 * rows]), rows
        avx2 = ops().gate_up_silu(x[rows:2 * rows], gate_up.packed, intermediate, gate_up.bias, avx512=False)
        assert torch.equal(avx2, together[rows:2 * rows]), rows
    with pytest.raises(RuntimeError, match="pack_gate_up_weight"):
        ops().gate_up_silu(torch.randn(2, 23), gate_up.packed, intermediate, None)  # another K


def test_rope_is_torchs_rotation_bit_for_bit(tiny_llama_dir):
    from transformers import AutoConfig

    from model_worker.model import rope_tables

    torch.manual_seed(0)
    cos, sin = rope_tables(AutoConfig.from_pretrained(tiny_llama_dir), 64, 512, torch.float32, torch.device("cpu"))
    qkv, positions = torch.randn(37, 15, 64), torch.randint(0, 512, (37,))
    qk = qkv[:, :12]
    expected = qk.roll(32, -1).mul_(sin[positions][:, None]).add_(qk * cos[positions][:, None])
    rotated = qkv.clone()
    ops().rope_(rotated, cos, sin, positions, 12)
    assert torch.equal(rotated[:, :12], expected)
    assert torch.equal(rotated[:, 12:], qkv[:, 12:])  # v heads untouched
    with pytest.raises(RuntimeError, match="position out of the tables"):
        ops().rope_(rotated, cos, sin, torch.full((37,), 512), 12)


def test_each_row_is_computed_alone():
    """A row's result does not depend on the rows beside it: a token's K/V are the same in any batch."""
    torch.manual_seed(0)
    x, weight = torch.randn(33, 576), torch.randn(576)
    assert torch.equal(ops().rms_norm(x, weight, 1e-5)[5], ops().rms_norm(x[5:6], weight, 1e-5)[0])


def _paged_call(dim: int, page: int, heads: int, kv_heads: int):
    """A pool, chunks and q/k/v for `paged_attention`: prefill parts (cold, over a cached prefix, longer than a
    task's 32 positions) and decode rows of unequal contexts; q/k/v strided views of one tensor, as the model's."""
    torch.manual_seed(0)
    pool = KVPool(256, BlockGeometry(2, kv_heads, dim, page, "float32"))
    pool.kv.normal_()
    parts = [(0, 37), (299, 1), (16, 20), (6, 1), (0, 1), (250, 70), (33, 3)]  # (start, length)
    chunks = []
    for i, (start, length) in enumerate(parts):
        pool.ensure_capacity(i, start + length)
        chunks.append(Chunk(pool.block_table(i), start, length))
    qkv = torch.randn(sum(length for _, length in parts), heads + 2 * kv_heads, dim)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    first = sum(length for _, length in parts[:5])  # the (250, 70) part's first row
    return pool, chunks, q, k, v, first


def _rows_alone(paged: PagedCpuBackend, q, k, v, block_table: list[int], first: int, start: int, length: int,
                pieces: int) -> list[tuple[slice, torch.Tensor]]:
    """The part's rows computed again in calls of `pieces` rows each (1: as decode rows)."""
    out = []
    for offset in range(0, length, pieces):
        rows = slice(first + offset, first + min(offset + pieces, length))
        chunk = Chunk(block_table, start + offset, rows.stop - rows.start)
        out.append((rows, paged.attend(1, q[rows], k[rows], v[rows], paged.prepare([chunk]))))
    return out


# 9/3 is the model's grouping; 8/2 and 4/4 put rows of two positions in one of the kernel's row blocks. Page 5 ends
# pages inside a vector, 12 mixes whole and partial vectors in a page.
@pytest.mark.parametrize("dim, page, heads, kv_heads",
                         [(64, 16, 9, 3), (128, 16, 9, 3), (64, 5, 9, 3), (64, 12, 8, 2), (64, 16, 4, 4)])
def test_paged_attention_matches_sdpa_and_computes_each_row_alone(dim, page, heads, kv_heads):
    """Every chunk kind in one call against SDPA over gathered K/V; then one part's rows again, one at a time as
    decode rows and in parts of another length: the same bits, so a token's attention does not depend on its batch
    or on where its chunk starts; and the AVX2 micro-kernels give the AVX-512 ones' bits (a CPU without AVX-512 runs
    the AVX2 ones on both sides)."""
    pool, chunks, q, k, v, first = _paged_call(dim, page, heads, kv_heads)
    sdpa, paged = SdpaBackend(pool, heads, kv_heads, dim), PagedCpuBackend(pool, heads, kv_heads, dim)
    expected = sdpa.attend(1, q, k, v, sdpa.prepare(chunks))
    meta = paged.prepare(chunks)
    got = paged.attend(1, q, k, v, meta)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    avx2 = ops().paged_attention(q, pool.k_layers[1], pool.v_layers[1], meta.block_tables, meta.starts, meta.lengths,
                                 paged.scale, avx512=False)
    assert torch.equal(avx2, got)
    for pieces in (1, 13):
        for rows, alone in _rows_alone(paged, q, k, v, pool.block_table(5), first, 250, 70, pieces):
            assert torch.equal(alone, got[rows]), (pieces, rows)


def test_paged_attention_never_reads_a_later_position():
    """A row attends to its own positions only, even beside later rows of its chunk: an infinite K and V at
    position 290 leave the rows before it finite and equal to their bits computed alone (rows of two positions share
    a row block with 8 query heads over 2 KV heads; the chunk's keys are transposed once for all its tiles, so the
    first tile's last block holds position 290)."""
    pool, chunks, q, k, v, first = _paged_call(64, 16, 8, 2)
    k[first + 40] = v[first + 40] = float("inf")  # position 250 + 40
    paged = PagedCpuBackend(pool, 8, 2, 64)
    got = paged.attend(1, q, k, v, paged.prepare(chunks))
    assert torch.isfinite(got[first:first + 40]).all() and not torch.isfinite(got[first + 40]).all()
    for rows, alone in _rows_alone(paged, q, k, v, pool.block_table(5), first, 250, 40, 1):
        assert torch.equal(alone, got[rows]), rows


def test_paged_attention_refuses_what_it_cannot_read():
    pool = KVPool(4, BlockGeometry(1, 1, 64, 16, "float32"))
    q, table, k, v = torch.zeros(1, 1, 64), torch.tensor([[0, 1]]), pool.k_layers[0], pool.v_layers[0]

    def attend(q, k, v, table, start, length):
        return ops().paged_attention(q, k, v, table, torch.tensor([start]), torch.tensor([length]), 0.125)

    with pytest.raises(RuntimeError, match="out of the block table"):
        attend(q, k, v, table, 32, 1)
    with pytest.raises(RuntimeError, match="page out of range"):
        attend(q, k, v, torch.tensor([[0, 9]]), 19, 1)
    with pytest.raises(RuntimeError, match="head_dim must be 64 or 128"):
        attend(q[..., :32], k[..., :32], v[..., :32], table, 2, 1)
    with pytest.raises(RuntimeError, match="lengths must sum to q's 1 rows"):
        attend(q, k, v, table, 0, 2)
    with pytest.raises(RuntimeError, match="at least one token"):
        attend(q, k, v, table, 0, 0)
    with pytest.raises(RuntimeError, match="start >= 0"):
        attend(q, k, v, table, -1, 1)
    with pytest.raises(RuntimeError, match="out of the block table"):
        attend(q, k, v, table, 2**62, 2**62)  # a sum that would overflow


def test_select_backend_uses_the_paged_kernel_only_where_it_applies():
    pool = KVPool(2, BlockGeometry(1, 3, 64, 16, "float32"))
    assert type(select_backend(pool, 9, 3, 64, kernels=True)) is PagedCpuBackend
    assert type(select_backend(pool, 9, 3, 64, kernels=False)) is SdpaBackend
    small = KVPool(2, BlockGeometry(1, 2, 16, 16, "float32"))
    assert type(select_backend(small, 4, 2, 16, kernels=True)) is SdpaBackend


# The model's projections (qkv, o, gate_up, down), and a width that is not a multiple of a panel's 16 columns.
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (576, 576), (3072, 576), (576, 1536), (40, 13)])
def test_linear_rows_are_bit_for_bit_the_same_at_every_row_count(out_features, in_features):
    """Each output is one FMA chain over the inputs in order: a row is the same alone (a decode step), beside a
    few (the tiles of few rows span more columns) and among 200 (a prefill), where oneDNN's one-row GEMV differed;
    and the AVX2 tiles give the AVX-512 tiles' bits (a CPU without AVX-512 runs the AVX2 ones on both sides)."""
    from model_worker.model import KernelLinear, linear_class

    assert linear_class(torch.float32, torch.device("cpu"), kernels=True) is KernelLinear
    torch.manual_seed(0)
    linear = KernelLinear(in_features, out_features, bias=out_features == 40)
    linear.pack()
    x = torch.randn(200, in_features)
    together = linear(x)
    torch.testing.assert_close(together, F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)
    for rows in (1, 2, 3, 5, 6, 7, 8, 9, 13, 64):
        assert torch.equal(linear(x[rows:2 * rows]), together[rows:2 * rows]), rows
        avx2 = ops().linear(x[rows:2 * rows], linear.packed, out_features, linear.bias, avx512=False)
        assert torch.equal(avx2, together[rows:2 * rows]), rows
    assert torch.equal(ops().linear(x, linear.packed, out_features, linear.bias, avx512=False), together)
    with torch.no_grad():
        linear.weight.zero_()  # the packed copy, made before this, is what it multiplies by
    assert torch.equal(linear(x[:3]), together[:3])


def test_linear_refuses_a_weight_it_was_not_packed_for():
    packed = ops().pack_linear_weight(torch.randn(40, 13))
    with pytest.raises(RuntimeError, match="pack_linear_weight"):
        ops().linear(torch.randn(2, 12), packed, 40, None)  # another K
    with pytest.raises(RuntimeError, match="pack_linear_weight"):
        ops().linear(torch.randn(2, 13), packed, 64, None)  # more columns than were packed
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops().linear(torch.randn(13, 2).t(), packed, 40, None)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: biases on q, k and v
def test_a_fused_layer_gives_the_layer_by_layer_bits(tmp_path, tokenizer, family):
    """`DecoderLayer.fused_forward` (one op a layer, the default on the paged CPU backend) gives the logits and the
    K/V in the pool of the model's layer-by-layer ops, bit for bit, over prefill chunks and single-token steps."""
    from transformers import LlamaConfig, Qwen2Config

    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=512, initializer_range=0.2, eos_token_id=2)
    config = (LlamaConfig if family == "llama" else Qwen2Config)(vocab_size=len(tokenizer), **shape)
    model_dir = save_tiny_model(tmp_path / family, config, tokenizer)
    ids = torch.randint(3, len(tokenizer), (45,)).tolist()
    results = []
    for fused in (True, False):
        engine = make_engine(model_dir, page_size=16)
        assert engine.model.fused_layers  # head_dim 64 on the paged kernel
        engine.model.fused_layers = fused
        logits = torch.cat([prefill_logits(engine, ids[:40], chunk=7), prefill_logits(engine, ids, chunk=1)])
        results.append((logits, engine.pool.kv.clone()))
    (fused_logits, fused_kv), (logits, kv) = results
    assert torch.equal(fused_logits, logits)
    assert torch.equal(fused_kv, kv)


def test_the_last_fused_layer_taking_only_the_logits_rows_gives_their_bits(tmp_path, tokenizer):
    """A step's forward with logits for some rows (the last rows of prefill chunks, a decode row, a run of scored
    rows) runs the fused last layer on those rows alone: their logits and every row's K/V are those of the
    layer-by-layer forward, bit for bit."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         initializer_range=0.2, eos_token_id=2)
    model_dir = save_tiny_model(tmp_path / "llama", config, tokenizer)
    lengths, starts = [37, 1, 20], [0, 44, 70]  # (position, length) of three sequences' chunks in one step
    ids = torch.randint(3, len(tokenizer), (sum(lengths),))
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
    contexts = [torch.randint(3, len(tokenizer), (start,)) for start in starts]
    logits_rows = torch.tensor([36, 37, 50, 51, 52, 57])  # chunk ends, the decode row, a run inside the third
    results = []
    for fused in (True, False):
        engine = make_engine(model_dir, page_size=16)
        engine.model.fused_layers = fused
        chunks = []
        for i, (start, length) in enumerate(zip(starts, lengths)):
            engine.pool.ensure_capacity(f"seq{i}", start + length)
            if start:  # a cached context the chunk attends to
                context = Chunk(engine.pool.block_table(f"seq{i}"), 0, start)
                engine.model(contexts[i], torch.arange(start), engine.backend.prepare([context]),
                             torch.tensor([start - 1]))
            chunks.append(Chunk(engine.pool.block_table(f"seq{i}"), start, length))
        logits = engine.model(ids, positions, engine.backend.prepare(chunks), logits_rows)
        results.append((logits, engine.pool.kv.clone()))
    (fused_logits, fused_kv), (logits, kv) = results
    assert fused_logits.shape == (len(logits_rows), len(tokenizer))
    assert torch.equal(fused_logits, logits)
    assert torch.equal(fused_kv, kv)


def test_decoder_layer_refuses_rows_out_of_order_or_past_the_step():
    layer = torch.ops.radixserve.decoder_layer
    with pytest.raises(RuntimeError, match="strictly increasing"):
        _one_layer_with_rows(layer, torch.tensor([3, 2]))
    with pytest.raises(RuntimeError, match="strictly increasing"):
        _one_layer_with_rows(layer, torch.tensor([4]))


def _one_layer_with_rows(layer, rows: torch.Tensor) -> torch.Tensor:
    """A 4-token chunk at position 0 of a 1-page cache through a random 64-wide layer, going on with `rows`."""
    tokens, width, heads, dim, inner = 4, 64, 1, 64, 128
    pack = ops().pack_linear_weight
    cache = torch.zeros(1, 16, 1, dim)
    positions = torch.arange(tokens)
    return layer(torch.randn(tokens, width), torch.randn(tokens, width), pack(torch.randn(3 * dim, width)), None,
                 pack(torch.randn(width, dim)), None, torch.ones(width),
                 ops().pack_gate_up_weight(torch.randn(2 * inner, width)), None, pack(torch.randn(width, inner)),
                 None, torch.ones(width), 1e-5, torch.ones(16, dim), torch.zeros(16, dim), positions, heads, cache,
                 cache.clone(), torch.zeros(tokens, dtype=torch.long), positions, torch.zeros(1, 1, dtype=torch.long),
                 torch.tensor([0]), torch.tensor([tokens]), 0.125, rows)
