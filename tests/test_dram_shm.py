import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached.tiers.dram_shm import SlabPool, cleanup_stale_segments, pid_alive
from radixserve.blocks.slab import SEGMENT_PREFIX, SHM_DIR, SlabSegment, is_segment_name, new_segment_name, segment_pid

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs Linux /dev/shm")

SLOT = 64
DEAD_PID = 2**22 + 1  # above Linux's pid_max limit, so never alive


def ours() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(SEGMENT_PREFIX)}


@pytest.fixture(autouse=True)
def nothing_left_in_dev_shm():
    before = ours()
    yield
    assert ours() <= before, f"left behind: {ours() - before}"


@pytest.fixture
def pool():
    pool = SlabPool.create(new_segment_name(), SLOT, 4)
    yield pool
    pool.check_integrity()
    pool.close()
    pool.unlink()


def test_allocate_in_order_then_runs_short(pool):
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free == 1
    assert pool.allocate(3) == [3]
    assert pool.allocate(1) == []
    assert pool.allocate(0) == []


def test_freed_slots_come_back_first(pool):
    pool.allocate(4)
    pool.free([1, 3])
    pool.check_integrity()
    assert pool.num_free == 2
    assert pool.allocate(2) == [3, 1]


@pytest.mark.parametrize("slots", [[0, 0], [2], [7], [-1]])
def test_bad_free_raises_and_frees_nothing(pool, slots):
    pool.allocate(2)
    with pytest.raises(ValueError, match="allocated slots"):
        pool.free(slots)
    assert pool.num_free == 2


def test_negative_allocate_raises(pool):
    with pytest.raises(ValueError):
        pool.allocate(-1)


@pytest.mark.parametrize("slot_bytes, num_slots", [(0, 4), (64, 0)])
def test_bad_geometry_raises(pool, slot_bytes, num_slots):
    with pytest.raises(ValueError, match=">= 1"):
        SlabPool.create(new_segment_name(), slot_bytes, num_slots)
    with pytest.raises(ValueError, match=">= 1"):
        SlabSegment.attach(pool.name, slot_bytes, num_slots)


def test_create_refuses_more_than_dev_shm_holds():
    free = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
    with pytest.raises(ValueError, match="bytes free"):
        SlabPool.create(new_segment_name(), 1 << 20, free // (1 << 20) + 1)


def test_views_are_disjoint_slots(pool):
    pool.view(1)[:] = b"\xff" * SLOT
    assert len(pool.view(1)) == SLOT
    assert bytes(pool.view(0)) == bytes(pool.view(2)) == bytes(SLOT)
    assert bytes(pool.segment.buffer[SLOT:2 * SLOT]) == b"\xff" * SLOT


@pytest.mark.parametrize("slot", [-1, 4])
def test_view_out_of_range_raises(pool, slot):
    with pytest.raises(ValueError, match="out of range"):
        pool.view(slot)


def test_attached_client_shares_bytes_and_cannot_allocate(pool):
    client = SlabSegment.attach(pool.name, SLOT, 4)
    client.view(2)[:5] = b"hello"
    assert bytes(pool.view(2)[:5]) == b"hello"
    assert not any(hasattr(client, owner_only) for owner_only in ("allocate", "free", "num_free", "unlink"))
    client.close()


def test_attach_checks_name_and_size(pool):
    for foreign in ("psm_1234", "radixserve_x_1", "radixserve_1_a/../../etc"):
        assert not is_segment_name(foreign)
        with pytest.raises(ValueError, match="not a radixserve segment"):
            SlabSegment.attach(foreign, SLOT, 4)
    with pytest.raises(FileNotFoundError):
        SlabSegment.attach(new_segment_name(), SLOT, 4)
    with pytest.raises(ValueError, match="holds"):
        SlabSegment.attach(pool.name, SLOT, 4096)


def test_close_refuses_while_a_view_is_alive(pool):
    other = SlabSegment.attach(pool.name, SLOT, 4)
    view = other.view(0)
    with pytest.raises(BufferError):
        other.close()
    view.release()
    other.close()


def run_python(code: str) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter at the repository's root; it must exit 0."""
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           cwd=Path(__file__).parent.parent)
    assert child.returncode == 0, child.stderr
    return child


def test_a_client_exiting_does_not_unlink_the_segment(pool):
    code = (f"from radixserve.blocks.slab import SlabSegment\n"
            f"p = SlabSegment.attach({pool.name!r}, {SLOT}, 4)\n"
            f"p.view(3)[:2] = b'ok'\n"
            f"p.close()\n")
    child = run_python(code)
    assert "leaked" not in child.stderr
    assert os.path.exists(os.path.join(SHM_DIR, pool.name))
    assert bytes(pool.view(3)[:2]) == b"ok"


def test_a_process_attaching_its_own_segment_exits_cleanly():
    """A benchmark maps the pool it created: its unlink, then its exit, must leave the segment gone and the resource
    tracker quiet (before Python 3.13, a second unregister of the name printed a KeyError traceback)."""
    code = ("from kvcached.tiers.dram_shm import SlabPool\n"
            "from radixserve.blocks.slab import SlabSegment, new_segment_name\n"
            f"pool = SlabPool.create(new_segment_name(), {SLOT}, 4)\n"
            f"client = SlabSegment.attach(pool.name, {SLOT}, 4)\n"
            "client.close(); pool.close(); pool.unlink()\n"
            "print(pool.name)\n")
    child = run_python(code)
    assert "Traceback" not in child.stderr and "leaked" not in child.stderr, child.stderr
    assert not os.path.exists(os.path.join(SHM_DIR, child.stdout.strip()))


def test_a_client_whose_pid_is_in_the_name_still_leaves_the_segment_to_its_owner(pool):
    """Containers sharing /dev/shm have pid namespaces of their own: a worker may run under the pid that kvcached's
    segment name carries. It did not create the segment, so its exit must not unlink it."""
    code = ("import os\n"
            "from radixserve.blocks.slab import SlabSegment\n"
            f"name = {pool.name!r}.replace({str(segment_pid(pool.name))!r}, str(os.getpid()), 1)\n"
            f"os.link(os.path.join({SHM_DIR!r}, {pool.name!r}), os.path.join({SHM_DIR!r}, name))\n"
            f"p = SlabSegment.attach(name, {SLOT}, 4)\n"
            "p.close()\n"
            "print(name)\n")
    child = run_python(code)
    alias = os.path.join(SHM_DIR, child.stdout.strip())
    try:
        assert os.path.exists(alias), "the client's exit unlinked a segment it had only attached"
    finally:
        if os.path.exists(alias):
            os.unlink(alias)


@pytest.mark.parametrize("name, pid", [
    ("radixserve_123_ab12cd34", 123),
    ("radixserve_123_", 123),
    ("radixserve_x1_ab12cd34", None),
    ("radixserve_123", None),
    ("other_123_ab12cd34", None),
])
def test_segment_pid(name, pid):
    assert segment_pid(name) == pid


def test_new_segment_name_embeds_our_pid():
    assert segment_pid(new_segment_name()) == os.getpid()
    assert segment_pid(new_segment_name(pid=7)) == 7


def test_pid_alive():
    child = subprocess.Popen(["true"])
    child.wait()
    assert pid_alive(os.getpid())
    assert not pid_alive(child.pid)
    assert not pid_alive(0) and not pid_alive(-1)


@pytest.fixture
def fake_segments():
    """Makes files in /dev/shm under a prefix of this test run's own; on Linux a POSIX shm segment is such a file."""
    prefix = f"{SEGMENT_PREFIX}test{os.getpid()}_"
    made = []

    def make(suffix: str) -> Path:
        made.append(Path(SHM_DIR, prefix + suffix))
        made[-1].write_bytes(b"x")
        return made[-1]

    yield prefix, make
    for path in made:
        path.unlink(missing_ok=True)


def test_cleanup_removes_only_segments_of_dead_owners(fake_segments):
    prefix, make = fake_segments
    dead, live, odd = make(f"{DEAD_PID}_ab12cd34"), make(f"{os.getpid()}_ab12cd34"), make("notapid_x")
    assert cleanup_stale_segments(prefix) == [dead.name]
    assert not dead.exists() and live.exists() and odd.exists()


def test_cleanup_asks_the_injected_liveness_check(fake_segments):
    prefix, make = fake_segments
    gone, kept = make("5_a"), make("6_b")
    asked = []
    removed = cleanup_stale_segments(prefix, live_pid_check=lambda pid: asked.append(pid) or pid == 6)
    assert removed == [gone.name] and sorted(asked) == [5, 6]
    assert kept.exists()


def test_cleanup_without_shm_dir_is_a_no_op(tmp_path):
    assert cleanup_stale_segments(shm_dir=str(tmp_path / "missing")) == []


def test_populating_faults_pages_in_without_changing_a_byte(pool):
    """`SlabPool.create` already populates on a thread; a second pass, and one in another mapping of the segment
    (workers attach without populating, but the method is the same), keep every byte written in between."""
    (slot,) = pool.allocate(1)
    pool.view(slot)[:4] = b"kv!!"
    pool.set_key(slot, b"k" * 16)
    assert pool.segment.populate()
    attached = SlabSegment.attach(pool.name, pool.slot_bytes, pool.num_slots)
    try:
        assert attached.populate()
        assert bytes(attached.view(slot)[:4]) == b"kv!!" and attached.header(slot).key == b"k" * 16
        assert all(bytes(pool.view(other)) == bytes(pool.slot_bytes) for other in range(pool.num_slots) if other != slot)
    finally:
        attached.close()
        pool.free([slot])


def test_closing_while_populating_stops_it(monkeypatch):
    monkeypatch.setattr("radixserve.blocks.slab.POPULATE_CHUNK_BYTES", 4096)  # many steps: close() lands mid-way
    segment = SlabPool.create(new_segment_name(), 4096, 4096)  # 16 MiB
    populating = segment.segment.populate_in_background()
    segment.close()
    populating.join(10)
    assert not populating.is_alive()
    segment.unlink()
