"""The packed weights' huge-page memory (model_worker.huge_pages): equal, aligned, independent copies that the
kernel backs with 2 MiB pages where THP is on."""

from pathlib import Path

import pytest
import torch

from model_worker.huge_pages import HUGE_PAGE, on_huge_pages

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


def test_copies_are_equal_aligned_separate_and_outlive_their_sources():
    source = [torch.randn(3, 700_000), torch.arange(35, dtype=torch.bfloat16).view(5, 7),
              torch.empty(0, dtype=torch.int64), torch.randn(8, 6).t()]  # the last one is not contiguous
    expected = [t.clone() for t in source]
    copies = on_huge_pages(source)
    del source
    for copy, want in zip(copies, expected):
        assert copy.shape == want.shape and copy.dtype == want.dtype and copy.is_contiguous()
        assert torch.equal(copy, want)
    assert all(c.data_ptr() % HUGE_PAGE == 0 for c in copies if c.numel())
    copies[0].fill_(1.5)  # the copies do not overlap
    for copy, want in zip(copies[1:], expected[1:]):
        assert torch.equal(copy, want)


@pytest.mark.skipif(not thp_enabled(), reason="transparent huge pages are off on this kernel")
def test_the_kernel_backs_them_with_huge_pages():
    (weights,) = on_huge_pages([torch.ones(HUGE_PAGE)])  # 8 MiB
    assert anon_huge_bytes(weights.data_ptr()) >= 2 * HUGE_PAGE
