"""A service's process-wide memory settings (`radixserve.server`): it keeps the memory it frees instead of faulting it
in again (`keep_freed_memory`), and its collector leaves what start-up created alone (`freeze_startup_heap`)."""

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


FREEZE = """
import gc, weakref
from radixserve.server import freeze_startup_heap
class Node:
    pass
def cycle():  # a garbage cycle: only the collector frees it
    node = Node()
    node.itself = node
    return weakref.ref(node)
startup = [[] for _ in range(20_000)]  # like a service's modules and tokenizer: alive for good
startup_garbage = cycle()
before = len(gc.get_objects())
freeze_startup_heap()
later = [[]]  # created while serving
walked = gc.get_objects()
later_garbage = cycle()
gc.collect()
print(before, len(walked), any(o is startup for o in walked), any(o is later for o in walked),
      gc.get_freeze_count(), startup_garbage() is None, later_garbage() is None)
"""


def test_startup_heap_is_frozen_and_garbage_is_still_collected():
    run = subprocess.run([sys.executable, "-c", FREEZE], capture_output=True, text=True, timeout=60, check=True)
    before, walked, startup_walked, later_walked, frozen, startup_freed, later_freed = run.stdout.split()
    assert int(before) > 20_000
    assert int(walked) < 1_000  # a full collection walks only what came after
    assert startup_walked == "False" and later_walked == "True"
    assert int(frozen) > 20_000
    assert startup_freed == later_freed == "True"  # garbage of start-up is not frozen, and later garbage goes
