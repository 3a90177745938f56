"""Small exact blocks for kvcached's tests: page size 4, prompts made of repeated page ids, a fake clock, a cache
that checks its invariants after every call, and LMDB-tier test blocks."""

from __future__ import annotations

from kvcached.cache import KVCache
from kvcached.tiers.lmdb_tier import ROOT_PARENT
from radixserve.blocks.geometry import BlockGeometry
from radixserve.blocks.keys import BlockHash

PAGE = 4
GEO = BlockGeometry(num_layers=2, num_kv_heads=1, head_dim=4, page_size=PAGE, dtype="float32", layout="page-first")
BLOCK = 2 * 2 * PAGE * 1 * 4 * 4  # layers * (K, V) * page * heads * head_dim * float32 = 256 bytes
SLOTS = 8
TTL = 10.0
FP = "model-a"
# The daemon's tests: 16 KiB blocks.
DAEMON_GEO = BlockGeometry(num_layers=4, num_kv_heads=2, head_dim=64, page_size=PAGE, dtype="float32",
                           layout="page-first")


def toks(*page_ids: int, tail: int = 0) -> list[int]:
    """A prompt whose i-th page is four copies of page_ids[i], plus `tail` tokens of a partial page."""
    return [t for p in page_ids for t in [p] * PAGE] + [99] * tail


def segment(cache, fingerprint: str = FP) -> str:
    """The namespace's segment name, which AllocateSlots must name."""
    return cache.namespace(fingerprint).pool.name


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Checked:
    """Forwards to a KVCache and runs `check_integrity()` after every public call, also one that raised."""

    def __init__(self, cache: KVCache) -> None:
        self.raw = cache

    def __getattr__(self, name: str):
        attr = getattr(self.raw, name)
        if name.startswith("_") or not callable(attr):
            return attr

        def checked(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            finally:
                self.raw.check_integrity()
        return checked


# LMDB tier blocks: block i's parent is block i - 1.
NS = "fp-a"
N = 100  # payload bytes of one test block


def key(i: int) -> BlockHash:
    return BlockHash((i + 1).to_bytes(16, "big"))  # never ROOT_PARENT


def parent(i: int) -> BlockHash:
    return ROOT_PARENT if i == 0 else key(i - 1)


def payload(i: int, n: int = N) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(n))
