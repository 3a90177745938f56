"""The L1 paged KV pool: one page-first tensor, a free list, reference counts and per-sequence block tables.

Layout (PAGE-FIRST, `radixserve.blocks.geometry`):  kv[page, layer, k_or_v, token_in_page, kv_head, head_dim]
One page of all layers is one block, contiguous, so moving it to or from a shared-memory slot is one copy.

Contracts:
- `allocate(n)` takes `n` pages off the free list with refcount 1, or raises `OutOfPages` and changes nothing.
- `incref(pages)` shares pages (a prefix held by several sequences); `decref(pages)` returns a page to the free
  list when its count reaches 0. A page id is never on the free list while its refcount is > 0.
- Block tables map a sequence id (any hashable) to its pages in token order; `release(seq_id)` decrefs them all at
  once. `fork(seq_id, new_id, tokens)` gives a new sequence the pages of another's first `tokens` tokens: full
  pages shared, a partial last page copied (both write their own next tokens into it).
- `check_integrity()` asserts: free pages + pages with refcount > 0 == total, and the free list has no duplicates.
The pool is not thread-safe: the engine calls it under its own lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

import torch

from radixserve.blocks.geometry import BlockGeometry


class OutOfPages(RuntimeError):
    """Raised by `allocate` when the free list is shorter than asked; the pool is unchanged."""


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def pages_for_budget(budget_gib: float, geometry: BlockGeometry) -> int:
    """How many blocks of `geometry` fit into `budget_gib` GiB (at least 1)."""
    return max(1, int(budget_gib * (1 << 30)) // geometry.block_bytes)


class KVPool:
    """A fixed number of KV pages of one geometry on one device; see the module docstring for the contracts."""

    def __init__(self, num_pages: int, geometry: BlockGeometry, device: torch.device | str = "cpu") -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages ({num_pages}) must be >= 1")
        self.num_pages = num_pages
        self.geometry = geometry
        self.num_layers = geometry.num_layers
        self.page_size = geometry.page_size
        # NOTE: zeros, not empty: masked-out slots still enter P@V as 0 * value, and 0 * NaN garbage would be NaN.
        self.kv = torch.zeros(num_pages, *geometry.block_shape, dtype=getattr(torch, geometry.dtype), device=device)
        # Per-layer strided views [page, token, kv_head, head_dim]: writes and gathers index them directly.
        self.k_layers = [self.kv[:, layer, 0] for layer in range(self.num_layers)]
        self.v_layers = [self.kv[:, layer, 1] for layer in range(self.num_layers)]
        self._free: deque[int] = deque(range(num_pages))
        self._refcount = [0] * num_pages
        self._tables: dict[str, list[int]] = {}

    # -- pages -------------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def allocate(self, n: int) -> list[int]:
        """`n` pages with refcount 1, lowest-recently-freed first; raises `OutOfPages` and changes nothing."""
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.popleft() for _ in range(n)]
        for page in pages:
            self._refcount[page] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for page in pages:
            if self._refcount[page] == 0:
                raise ValueError(f"page {page} is free; only held pages can be shared")
            self._refcount[page] += 1

    def decref(self, pages: list[int]) -> None:
        """Drops one reference per page; pages reaching 0 go to the back of the free list."""
        for page in pages:
            if self._refcount[page] == 0:
                raise ValueError(f"page {page} is already free")
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                self._free.append(page)

    # -- block tables ------------------------------------------------------------------------------------------
    def block_table(self, seq_id: Hashable) -> list[int]:
        """The pages of `seq_id` in token order (the live list: callers must not mutate it)."""
        return self._tables.setdefault(seq_id, [])

    def ensure_capacity(self, seq_id: Hashable, num_tokens: int) -> None:
        """Grows the table of `seq_id` so it holds `num_tokens` tokens; raises `OutOfPages` and changes nothing."""
        table = self.block_table(seq_id)
        missing = pages_for_tokens(num_tokens, self.page_size) - len(table)
        if missing > 0:
            table.extend(self.allocate(missing))

    def release(self, seq_id: Hashable) -> None:
        """Drops the table of `seq_id` and one reference to each of its pages; unknown ids are a no-op."""
        self.decref(self._tables.pop(seq_id, []))

    def fork(self, seq_id: Hashable, new_id: Hashable, num_tokens: int) -> None:
        """Gives `new_id` (which has no table) the pages of the first `num_tokens` tokens of `seq_id`: the full ones
        shared, a partial last one copied; raises `OutOfPages` and changes nothing."""
        if self._tables.get(new_id):
            raise ValueError(f"sequence {new_id!r} already has pages")
        table = self.block_table(seq_id)
        full, partial = divmod(num_tokens, self.page_size)
        if full + bool(partial) > len(table):
            raise ValueError(f"sequence {seq_id!r} holds {len(table)} pages, fewer than {num_tokens} tokens need")
        copied = self.allocate(1) if partial else []
        if copied:
            self.kv[copied[0]].copy_(self.kv[table[full]])
        self.incref(table[:full])
        self._tables[new_id] = table[:full] + copied

    # -- data --------------------------------------------------------------------------------------------------
    def write(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores `k`, `v` [tokens, kv_heads, head_dim] of `layer` at (pages[i], offsets[i])."""
        self.k_layers[layer][pages, offsets] = k
        self.v_layers[layer][pages, offsets] = v

    def page_view(self, page: int) -> torch.Tensor:
        """All layers' K and V of one page: a contiguous view [layer, 2, page_size, kv_heads, head_dim]."""
        return self.kv[page]

    def check_integrity(self) -> None:
        held = sum(1 for count in self._refcount if count > 0)
        if len(set(self._free)) != len(self._free):
            raise AssertionError("free list has duplicates")
        if any(self._refcount[page] for page in self._free):
            raise AssertionError("a page on the free list has a reference")
        if held + len(self._free) != self.num_pages:
            raise AssertionError(f"held {held} + free {len(self._free)} != total {self.num_pages}")
