"""`radixserve.server.keep_freed_memory`: a service keeps the memory it frees instead of faulting it in again."""

import subprocess
import sys

import pytest

FREE_AND_MEASURE = """
import sys
from radixserve.server import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
block = b"x" * (24 << 20)  # 24 MiB, every page touched
held = rss()
del block
print(held - rss())
"""


def returned_bytes(mode: str) -> int:
    """How much of a freed, touched 24 MiB block a fresh interpreter gave back to the kernel."""
    run = subprocess.run([sys.executable, "-c", FREE_AND_MEASURE, mode], capture_output=True, text=True, timeout=60,
                         check=True)
    return int(run.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_stays_in_the_process():
    assert returned_bytes("default") > 16 << 20  # glibc's default gives it back: the check can tell
    assert returned_bytes("keep") < 1 << 20
