"""The shape of one cache block, the same in a worker's L1 pool, kvcached's L2 slots and its L3 values.

Layout (PAGE-FIRST): block[layer, k_or_v, token_in_page, kv_head, head_dim]. One page of all layers is one
contiguous chunk, so moving a block between tiers is one copy (measured 17 GB/s, against 0.6 GB/s for a gather into
a layer-first layout: docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.v1 import common_pb2

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LAYOUT = "page-first:[page,layer,kv,token,kv_head,head_dim]"


@dataclass(frozen=True)
class BlockGeometry:
    """Raises ValueError for a size below 1 or a dtype outside `DTYPE_BYTES`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str  # a key of DTYPE_BYTES, as torch names it without "torch."
    layout: str = LAYOUT

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"geometry.dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.page_size) < 1:
            raise ValueError(f"every geometry size must be >= 1: {self}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def token_bytes(self) -> int:
        """K and V of one token across all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        return self.page_size * self.token_bytes

    def to_pb(self) -> common_pb2.BlockGeometry:
        return common_pb2.BlockGeometry(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                                        head_dim=self.head_dim, page_size=self.page_size, dtype=self.dtype,
                                        layout=self.layout)

    @classmethod
    def from_pb(cls, pb: common_pb2.BlockGeometry) -> BlockGeometry:
        """Raises ValueError for an unset or invalid field."""
        return cls(pb.num_layers, pb.num_kv_heads, pb.head_dim, pb.page_size, pb.dtype, pb.layout)
