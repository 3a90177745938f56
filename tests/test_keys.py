import struct
from hashlib import blake2b

import pytest

from radixserve.blocks.keys import DIGEST_BYTES, block_hashes, namespace_key

NS = namespace_key("smollm2-135m/bf16/ps4", "")


def test_known_answer_pins_the_format():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    h0 = blake2b(bytes(16) + struct.pack("<4I", 1, 2, 3, 4), key=NS, digest_size=16).digest()
    h1 = blake2b(h0 + struct.pack("<4I", 5, 6, 7, 8), key=NS, digest_size=16).digest()
    assert block_hashes(NS, tokens, 4) == [h0, h1]


@pytest.mark.parametrize("n_tokens, page_size, n_hashes", [
    (0, 4, 0), (3, 4, 0), (4, 4, 1), (11, 4, 2), (12, 4, 3), (5, 1, 5), (4096, 16, 256),
])
def test_one_hash_per_full_page(n_tokens, page_size, n_hashes):
    hashes = block_hashes(NS, list(range(n_tokens)), page_size)
    assert len(hashes) == n_hashes
    assert all(isinstance(h, bytes) and len(h) == DIGEST_BYTES for h in hashes)


def test_partial_trailing_page_is_ignored():
    tokens = list(range(10))
    assert block_hashes(NS, tokens, 4) == block_hashes(NS, tokens[:8], 4)


@pytest.mark.parametrize("changed_page", [0, 1, 2])
def test_chain_changes_from_the_changed_page_on(changed_page):
    tokens = list(range(12))
    other = tokens.copy()
    other[changed_page * 4 + 1] += 100
    a, b = block_hashes(NS, tokens, 4), block_hashes(NS, other, 4)
    assert a[:changed_page] == b[:changed_page]
    assert all(x != y for x, y in zip(a[changed_page:], b[changed_page:], strict=True))


def test_same_page_at_another_position_hashes_differently():
    a = block_hashes(NS, [7, 7, 7, 7, 7, 7, 7, 7], 4)
    assert a[0] != a[1]


@pytest.mark.parametrize("ns_a, ns_b", [
    (("m1", ""), ("m2", "")),
    (("m1", ""), ("m1", "tenant-a")),
    (("m1", "tenant-a"), ("m1", "tenant-b")),
    (("ab", "c"), ("a", "bc")),  # fields are length-prefixed
])
def test_namespaces_separate_keys(ns_a, ns_b):
    tokens = list(range(8))
    a = block_hashes(namespace_key(*ns_a), tokens, 4)
    b = block_hashes(namespace_key(*ns_b), tokens, 4)
    assert not set(a) & set(b)


def test_namespace_key_is_stable():
    assert namespace_key("m", "s") == namespace_key("m", "s")
    assert len(namespace_key("m", "s")) == DIGEST_BYTES


@pytest.mark.parametrize("namespace, tokens, page_size, message", [
    (NS, [1, 2, 3, 4], 0, "page_size"),
    (b"", [1, 2, 3, 4], 4, "namespace"),
    (bytes(65), [1, 2, 3, 4], 4, "namespace"),
    (NS, [1, 2, 3, -1], 4, "token ids"),
    (NS, [1, 2, 3, 2**32], 4, "token ids"),
])
def test_bad_input_raises_value_error(namespace, tokens, page_size, message):
    with pytest.raises(ValueError, match=message):
        block_hashes(namespace, tokens, page_size)


def test_accepts_any_int_sequence():
    assert block_hashes(NS, tuple(range(8)), 4) == block_hashes(NS, range(8), 4)
