"""The weights' and KV pool's huge-page memory (model_worker.huge_pages): zeroed, aligned, independent tensors that
the kernel backs with 2 MiB pages where THP is on."""

from pathlib import Path

import pytest
import torch

from model_worker.huge_pages import HUGE_PAGE, huge_page_tensors, on_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_enabled() -> bool:
    return THP.exists() and "[never]" not in THP.read_text()


def anon_huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping of this process that contains `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_tensors_are_zeroed_aligned_and_separate():
    a, b, empty = huge_page_tensors([((3, 700_000), torch.float32), ((5, 7), torch.bfloat16), ((0,), torch.int64)])
    assert (a.shape, a.dtype, b.shape, b.dtype, empty.shape) == ((3, 700_000), torch.float32, (5, 7),
                                                                   torch.bfloat16, (0,))
    assert a.is_contiguous() and b.is_contiguous()
    assert a.data_ptr() % HUGE_PAGE == 0 and b.data_ptr() % HUGE_PAGE == 0
    assert not a.any() and not b.any()
    a.fill_(1.5)  # the tensors do not overlap
    assert not b.any()
    b.fill_(2.0)
    assert (a == 1.5).all()


def test_copies_are_equal_and_outlive_their_sources():
    source = [torch.randn(1024, 600), torch.arange(10, dtype=torch.int32)]
    copies = on_huge_pages(source)
    expected = [t.clone() for t in source]
    del source
    for copy, want in zip(copies, expected):
        assert torch.equal(copy, want)


@pytest.mark.skipif(not thp_enabled(), reason="transparent huge pages are off on this kernel")
def test_the_kernel_backs_them_with_huge_pages():
    (weights,) = huge_page_tensors([((4 * HUGE_PAGE // 4,), torch.float32)])
    weights.fill_(1.0)  # faulted in: 4 MiB on 2 MiB pages
    assert anon_huge_bytes(weights.data_ptr()) >= 2 * HUGE_PAGE
