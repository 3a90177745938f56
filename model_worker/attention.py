"""Paged attention backends behind one small interface, chosen once by `select_backend`.

A step's batch is a list of `Chunk`s, one per sequence, laid out back to back in the flat token dimension:

    flat tokens: | chunk 0 (prefill, 5 tokens) | chunk 1 (decode, 1) | chunk 2 (decode, 1) | ...
    chunk i covers positions [start, start + length) of its sequence; positions [0, start) are already in the pool.

`prepare(chunks)` builds the step's metadata once (index tensors on the device); `attend(layer, q, k, v, meta)` is
called by every layer: it writes the chunk's new K/V into the pool, then attends each query to positions
[0, start + its offset] of its own sequence. `PagedCpuBackend` attends every chunk in one kernel call; in
`SdpaBackend`, chunks of length 1 ("decode rows", wherever they sit) are attended in one batched call and longer
chunks ("prefill parts") one call each.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from model_worker.kv_pool import KVPool, pages_for_tokens

log = logging.getLogger("model_worker.attention")


class Chunk(NamedTuple):
    """`length` new tokens of one sequence at positions [start, start + length); its pages in `block_table`."""

    block_table: list[int]
    start: int
    length: int


def slot_indices(chunks: list[Chunk], page_size: int) -> tuple[list[int], list[int]]:
    """(page, offset) of every new token, in flat order."""
    pages: list[int] = []
    offsets: list[int] = []
    for chunk in chunks:
        for pos in range(chunk.start, chunk.start + chunk.length):
            pages.append(chunk.block_table[pos // page_size])
            offsets.append(pos % page_size)
    return pages, offsets


class AttentionBackend(ABC):
    """Writes new K/V into the pool and attends; one instance per engine, chosen in `__init__`."""

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    @abstractmethod
    def prepare(self, chunks: list[Chunk]) -> Any:
        """Metadata for one forward over `chunks`; the block tables must already cover every new position."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
        """q [T, heads, dim], k/v [T, kv_heads, dim] of the new tokens -> attention output [T, heads * dim]."""


# -- torch SDPA (CPU and CUDA) -----------------------------------------------------------------------------------
class PrefillPart(NamedTuple):
    rows: slice
    pages: torch.Tensor | None  # None: no cached prefix, attend to the fresh k/v with is_causal
    context: int
    mask: torch.Tensor | None  # [length, context] additive (`additive_mask`): causal with offset `start`


@dataclass(frozen=True)
class SdpaMetadata:
    write_pages: torch.Tensor
    write_offsets: torch.Tensor
    prefills: list[PrefillPart]
    decode_rows: torch.Tensor | None  # flat rows of the length-1 chunks, or None when there are none
    decode_pages: torch.Tensor | None  # [B, max_pages]; short tables padded with their first page (masked)
    decode_context: int  # max context over decode rows
    decode_mask: torch.Tensor | None  # [B, 1, 1, decode_context] additive; None when all contexts are equal


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `allowed`, -inf elsewhere: the float mask SDPA's CPU kernel converts a bool mask into on every call.
    Built once per step and shared by every layer, it gives bit-identical outputs, and a 112-token chunk over 2,000
    positions took 4.41 instead of 5.86 ms a layer (512 over 2,048: 17.9 instead of 19.8; AMD EPYC, 2 cores).
    Every row must allow at least one position."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class SdpaBackend(AttentionBackend):
    """`torch.nn.functional.scaled_dot_product_attention` over K/V gathered from the pool's pages.

    Gathers land in two buffers reused by every layer and call, doubled when a step needs more pages (a context
    grows a page at a time, so exact growth would reallocate every 16 decode steps): a fresh tensor per gather cost
    6.5 ms a step against 1.6 ms (batch 4, 17 pages each, 30 layers). A layer's attention consumes its gather before
    the next one overwrites it.
    """

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(pool, num_heads, num_kv_heads, head_dim)
        self._gathered = (pool.k_layers[0][:0].clone(), pool.v_layers[0][:0].clone())

    def prepare(self, chunks: list[Chunk]) -> SdpaMetadata:
        device = self.pool.kv.device
        pages, offsets = slot_indices(chunks, self.pool.page_size)
        prefills: list[PrefillPart] = []
        decodes: list[tuple[int, Chunk]] = []
        row = 0
        for chunk in chunks:
            if chunk.length == 1:
                decodes.append((row, chunk))
            else:
                prefills.append(self._prefill_part(row, chunk, device))
            row += chunk.length
        return SdpaMetadata(
            write_pages=torch.tensor(pages, dtype=torch.long, device=device),
            write_offsets=torch.tensor(offsets, dtype=torch.long, device=device),
            prefills=prefills,
            **self._decode_fields(decodes, device),
        )

    def _prefill_part(self, row: int, chunk: Chunk, device: torch.device) -> PrefillPart:
        rows = slice(row, row + chunk.length)
        if chunk.start == 0:
            return PrefillPart(rows, None, chunk.length, None)
        context = chunk.start + chunk.length
        pages = torch.tensor(chunk.block_table[:pages_for_tokens(context, self.pool.page_size)], device=device)
        query_pos = torch.arange(chunk.start, context, device=device)
        allowed = torch.arange(context, device=device)[None, :] <= query_pos[:, None]
        return PrefillPart(rows, pages, context, additive_mask(allowed, self.pool.kv.dtype))

    def _decode_fields(self, decodes: list[tuple[int, Chunk]], device: torch.device) -> dict[str, Any]:
        if not decodes:
            return dict(decode_rows=None, decode_pages=None, decode_context=0, decode_mask=None)
        contexts = [chunk.start + 1 for _, chunk in decodes]
        max_context = max(contexts)
        max_pages = pages_for_tokens(max_context, self.pool.page_size)
        tables = []
        for (_, chunk), context in zip(decodes, contexts):
            own = chunk.block_table[:pages_for_tokens(context, self.pool.page_size)]
            tables.append(own + [own[0]] * (max_pages - len(own)))
        mask = None
        if min(contexts) != max_context:
            lengths = torch.tensor(contexts, dtype=torch.long, device=device)
            allowed = torch.arange(max_context, device=device)[None, :] < lengths[:, None]
            mask = additive_mask(allowed, self.pool.kv.dtype)[:, None, None, :]
        return dict(
            decode_rows=torch.tensor([r for r, _ in decodes], dtype=torch.long, device=device),
            decode_pages=torch.tensor(tables, dtype=torch.long, device=device),
            decode_context=max_context,
            decode_mask=mask,
        )

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SdpaMetadata) -> torch.Tensor:
        self.pool.write(layer, meta.write_pages, meta.write_offsets, k, v)
        if meta.decode_rows is not None and not meta.prefills:
            return self._decode(layer, q, meta)
        out = torch.empty_like(q)
        for part in meta.prefills:
            out[part.rows] = self._prefill(layer, q[part.rows], k[part.rows], v[part.rows], part)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._decode(layer, q[meta.decode_rows], meta).view(-1, *q.shape[1:])
        return out.view(q.shape[0], -1)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              causal: bool) -> torch.Tensor:
        # q [B, heads, Lq, dim], k/v [B, kv_heads, Lk, dim]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale,
                                              enable_gqa=self.num_heads != self.num_kv_heads)

    def _gather(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [*pages.shape, page_size, kv_heads, dim] of `layer`'s `pages`, in the reused buffers."""
        flat = pages.flatten()
        if len(flat) > len(self._gathered[0]):
            size = max(len(flat), 2 * len(self._gathered[0]))
            self._gathered = tuple(buf.new_empty((size, *buf.shape[1:])) for buf in self._gathered)
        k_buf, v_buf = (buf[:len(flat)] for buf in self._gathered)
        torch.index_select(self.pool.k_layers[layer], 0, flat, out=k_buf)
        torch.index_select(self.pool.v_layers[layer], 0, flat, out=v_buf)
        shape = (*pages.shape, *k_buf.shape[1:])
        return k_buf.view(shape), v_buf.view(shape)

    def _prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, part: PrefillPart) -> torch.Tensor:
        if part.pages is not None:
            k, v = (t.flatten(0, 1)[:part.context] for t in self._gather(layer, part.pages))
        out = self._sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], part.mask,
                         causal=part.pages is None)
        return out[0].transpose(0, 1)

    def _decode(self, layer: int, q: torch.Tensor, meta: SdpaMetadata) -> torch.Tensor:
        batch = q.shape[0]
        k, v = (t.flatten(1, 2)[:, :meta.decode_context] for t in self._gather(layer, meta.decode_pages))
        out = self._sdpa(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), meta.decode_mask, causal=False)
        return out.view(batch, -1)


PAGED_CPU_HEAD_DIMS = (64, 128)  # what `paged_attention` is compiled for


@dataclass(frozen=True)
class PagedMetadata:
    write_pages: torch.Tensor
    write_offsets: torch.Tensor
    block_tables: torch.Tensor  # int64 [chunks, max_pages], short tables padded with page 0 (never read)
    starts: torch.Tensor  # int64 [chunks]
    lengths: torch.Tensor  # int64 [chunks]


class PagedCpuBackend(AttentionBackend):
    """Every chunk, prefill part or decode row, attends through `torch.ops.radixserve.paged_attention`
    (`model_worker.cpu_kernels`, float32) in one call a layer: K/V read in place through the block tables, no
    gather and no mask, one read per group of query heads, and each row computed the same way whatever the batch
    beside it, so a token's K/V are the same computed in a decode step, a cold prefill or over a cached prefix."""

    def prepare(self, chunks: list[Chunk]) -> PagedMetadata:
        device = self.pool.kv.device
        pages, offsets = slot_indices(chunks, self.pool.page_size)
        tables = [chunk.block_table[:pages_for_tokens(chunk.start + chunk.length, self.pool.page_size)]
                  for chunk in chunks]
        width = max(len(table) for table in tables)

        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return PagedMetadata(write_pages=tensor(pages), write_offsets=tensor(offsets),
                             block_tables=tensor([table + [0] * (width - len(table)) for table in tables]),
                             starts=tensor([chunk.start for chunk in chunks]),
                             lengths=tensor([chunk.length for chunk in chunks]))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        self.pool.write(layer, meta.write_pages, meta.write_offsets, k, v)
        return torch.ops.radixserve.paged_attention(q, self.pool.k_layers[layer], self.pool.v_layers[layer],
                                                    meta.block_tables, meta.starts, meta.lengths, self.scale)


# -- flash-attn (CUDA only) --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlashMetadata:
    write_pages: torch.Tensor
    write_offsets: torch.Tensor
    decode_only: bool
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    cu_seqlens_k: torch.Tensor  # int32 [B + 1]
    seqlens_k: torch.Tensor  # int32 [B]: context length of each sequence after this step
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # int32 [B, max_pages], padded with page 0 (never read past seqlens_k)


def flash_metadata(chunks: list[Chunk], page_size: int, device: torch.device | str) -> FlashMetadata:
    """The CPU-side bookkeeping of the flash-attn backend (unit-testable without CUDA)."""
    pages, offsets = slot_indices(chunks, page_size)
    q_lens = [c.length for c in chunks]
    k_lens = [c.start + c.length for c in chunks]
    max_pages = max(pages_for_tokens(n, page_size) for n in k_lens)
    table = [c.block_table[:pages_for_tokens(n, page_size)] for c, n in zip(chunks, k_lens)]
    table = [t + [0] * (max_pages - len(t)) for t in table]

    def cumulative(lengths: list[int]) -> torch.Tensor:
        return torch.tensor([0] + lengths, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)

    return FlashMetadata(
        write_pages=torch.tensor(pages, dtype=torch.long, device=device),
        write_offsets=torch.tensor(offsets, dtype=torch.long, device=device),
        decode_only=max(q_lens) == 1,
        cu_seqlens_q=cumulative(q_lens),
        cu_seqlens_k=cumulative(k_lens),
        seqlens_k=torch.tensor(k_lens, dtype=torch.int32, device=device),
        max_seqlen_q=max(q_lens),
        max_seqlen_k=max(k_lens),
        block_table=torch.tensor(table, dtype=torch.int32, device=device),
    )


class FlashAttentionBackend(AttentionBackend):
    """flash-attn 2 paged kernels reading the pool's per-layer views [page, token, kv_head, dim] in place."""

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(pool, num_heads, num_kv_heads, head_dim)
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # lazily: CUDA-only dependency

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    def prepare(self, chunks: list[Chunk]) -> FlashMetadata:
        return flash_metadata(chunks, self.pool.page_size, self.pool.kv.device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: FlashMetadata) -> torch.Tensor:
        self.pool.write(layer, meta.write_pages, meta.write_offsets, k, v)
        k_cache, v_cache = self.pool.k_layers[layer], self.pool.v_layers[layer]
        if meta.decode_only:
            out = self._with_kvcache(q[:, None], k_cache, v_cache, cache_seqlens=meta.seqlens_k,
                                     block_table=meta.block_table, softmax_scale=self.scale, causal=True)
        else:
            out = self._varlen(q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q,
                               meta.max_seqlen_k, softmax_scale=self.scale, causal=True,
                               block_table=meta.block_table)
        return out.reshape(q.shape[0], -1)


FLASH_PAGE_MULTIPLE = 256  # NOTE: flash-attn 2's paged kernels need page_block_size % 256 == 0.


def select_backend(pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int,
                   kernels: bool = False) -> AttentionBackend:
    """flash-attn when the pool is on CUDA, its page size suits the kernels and `flash_attn` imports; else the paged
    CPU kernel when `kernels` (the fused CPU kernels are loaded; float32 CPU pool) and the head size is one it is
    compiled for; else SDPA."""
    reason = _flash_unusable_reason(pool)
    if reason is None:
        try:
            return FlashAttentionBackend(pool, num_heads, num_kv_heads, head_dim)
        except ImportError as exc:
            reason = f"flash_attn does not import ({exc})"
    if kernels and head_dim in PAGED_CPU_HEAD_DIMS:
        log.info("attention backend: paged CPU kernel", extra={"reason": reason})
        return PagedCpuBackend(pool, num_heads, num_kv_heads, head_dim)
    log.info("attention backend: torch SDPA", extra={"reason": reason})
    return SdpaBackend(pool, num_heads, num_kv_heads, head_dim)


def _flash_unusable_reason(pool: KVPool) -> str | None:
    if pool.kv.device.type != "cuda":
        return "no CUDA"
    if pool.page_size % FLASH_PAGE_MULTIPLE:
        return f"page size {pool.page_size} is not a multiple of {FLASH_PAGE_MULTIPLE}"
    return None
