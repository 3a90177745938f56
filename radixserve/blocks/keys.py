"""Block keys: a chained hash over the full pages of a token sequence.

    h_i = H_ns(h_{i-1} || tokens of page i),   h_{-1} = 16 zero bytes

H_ns is BLAKE2b-128 keyed with the namespace, so a page's key commits to the namespace (model fingerprint and
cache salt), to every token before it, and to its own tokens: equal keys mean equal prefixes under the same model.
Tokens are encoded as little-endian uint32, 4 bytes each. A partial trailing page is never hashed.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

DIGEST_BYTES = 16  # 128 bits: collisions stay negligible far beyond any cache size, and keys stay small
_SEED = bytes(DIGEST_BYTES)
_TOKEN_BYTES = 4


def namespace_key(fingerprint: str, cache_salt: str) -> bytes:
    """The namespace for `block_hashes`: a 16-byte digest of the model fingerprint and the tenant's cache salt.

    Fields are length-prefixed, so ("ab", "c") and ("a", "bc") give different namespaces.
    """
    h = blake2b(digest_size=DIGEST_BYTES, person=b"radixserve-ns")
    for part in (fingerprint.encode(), cache_salt.encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def block_hashes(namespace: bytes, token_ids: Sequence[int], page_size: int) -> list[BlockHash]:
    """One key per full page of `token_ids`, in order: `len(token_ids) // page_size` keys.

    Raises ValueError for a page size below 1, a namespace that is not 1-64 bytes, or a token id outside [0, 2**32).
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if not 1 <= len(namespace) <= 64:
        raise ValueError(f"namespace must be 1-64 bytes (a BLAKE2b key), got {len(namespace)}")
    step = page_size * _TOKEN_BYTES
    data = memoryview(_encode(token_ids[: len(token_ids) // page_size * page_size]))
    base = blake2b(digest_size=DIGEST_BYTES, key=namespace)
    prev, out = _SEED, []
    for start in range(0, len(data), step):
        h = base.copy()
        h.update(prev)
        h.update(data[start:start + step])
        prev = h.digest()
        out.append(BlockHash(prev))
    return out


def _encode(token_ids: Sequence[int]) -> bytes:
    try:
        arr = array("I", token_ids)
    except OverflowError as e:
        raise ValueError(f"token ids must be in [0, 2**32): {e}") from None
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()
