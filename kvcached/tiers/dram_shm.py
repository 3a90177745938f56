"""L2: a slab pool of fixed-size slots in one POSIX shared-memory segment.

kvcached creates the segment and owns the free list (`SlabPool.create`); workers attach by name and read or write
slot bytes (`SlabPool.attach`). The pool only hands out slots: which block a slot holds is the radix index's business.

Segment names are `radixserve_<owner pid>_<8 hex>`, so `cleanup_stale_segments` can remove the segments of a dead
daemon. NOTE: on Linux a segment is a file in /dev/shm and outlives its processes until someone unlinks it.
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Callable, Iterable
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

SEGMENT_PREFIX = "radixserve_"
SHM_DIR = "/dev/shm"


class SlabPool:
    """`num_slots` slots of `slot_bytes` bytes each, slot i at byte offset `i * slot_bytes`.

    Allocation state lives only in the owner's process; an attached client may only `view` slots, `close`, and
    read `buffer`. Views are memoryviews into the segment: release them (or drop them) before `close()`, which
    raises BufferError while any is alive. The pool is not thread-safe.
    """

    def __init__(self, shm: SharedMemory, slot_bytes: int, num_slots: int, owner: bool) -> None:
        """Use `create` or `attach`."""
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self._shm = shm
        self._owner = owner
        self._free = list(range(num_slots - 1, -1, -1)) if owner else []  # a stack: allocate pops the end
        self._used: set[int] = set()

    @classmethod
    def create(cls, name: str, slot_bytes: int, num_slots: int) -> SlabPool:
        """Creates the segment, zero-filled, and owns it. Raises FileExistsError when `name` exists, ValueError for
        a bad geometry or one larger than the free space of /dev/shm.

        NOTE: the segment is sparse, so creating it always succeeds; a write past a full /dev/shm (64 MB by default
        in Docker) would kill the writer with SIGBUS. Hence the free-space check here, once, up front.
        """
        _check_geometry(slot_bytes, num_slots)
        size = slot_bytes * num_slots
        if os.path.isdir(SHM_DIR) and _free_bytes(SHM_DIR) < size:
            raise ValueError(f"{SHM_DIR} has {_free_bytes(SHM_DIR)} bytes free, the pool needs {size}")
        return cls(SharedMemory(name, create=True, size=size), slot_bytes, num_slots, owner=True)

    @classmethod
    def attach(cls, name: str, slot_bytes: int, num_slots: int) -> SlabPool:
        """Attaches to an existing segment without owning it: exiting never unlinks it. Raises FileNotFoundError
        when `name` does not exist, ValueError when it is smaller than the geometry asks."""
        _check_geometry(slot_bytes, num_slots)
        shm = _attach_untracked(name)
        if shm.size < slot_bytes * num_slots:
            shm.close()
            raise ValueError(f"segment {name} holds {shm.size} bytes, not {num_slots} x {slot_bytes}")
        return cls(shm, slot_bytes, num_slots, owner=False)

    @property
    def name(self) -> str:
        return self._shm.name

    @property
    def num_free(self) -> int:
        self._require_owner("num_free")
        return len(self._free)

    @property
    def buffer(self) -> memoryview:
        """All slots as one memoryview, e.g. for `torch.frombuffer`; it counts as a view for `close()`."""
        return self._shm.buf[: self.slot_bytes * self.num_slots]

    def allocate(self, n: int) -> list[int]:
        """Takes up to `n` free slots (fewer when the pool runs short); the caller frees them."""
        self._require_owner("allocate")
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        start = len(self._free) - min(n, len(self._free))
        taken = self._free[start:][::-1]
        del self._free[start:]
        self._used.update(taken)
        return taken

    def free(self, slots: Iterable[int]) -> None:
        """Returns allocated slots to the pool. Raises ValueError, freeing none, unless all are allocated and
        distinct. A freed slot may be handed out by the next `allocate`: stop using its views first."""
        self._require_owner("free")
        slots = list(slots)
        if len(set(slots)) != len(slots) or not self._used.issuperset(slots):
            raise ValueError(f"can only free allocated slots, each once: {slots}")
        self._used.difference_update(slots)
        self._free.extend(slots)

    def view(self, slot: int) -> memoryview:
        """The bytes of `slot`, writable, shared with every process attached to the segment."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.num_slots})")
        start = slot * self.slot_bytes
        return self._shm.buf[start:start + self.slot_bytes]

    def check_integrity(self) -> None:
        """Raises AssertionError unless free and allocated slots partition the pool (owner only)."""
        self._require_owner("check_integrity")
        free = set(self._free)
        if len(free) != len(self._free) or free & self._used or len(free) + len(self._used) != self.num_slots:
            raise AssertionError(f"{len(self._free)} free + {len(self._used)} used != {self.num_slots} slots")
        if not all(0 <= s < self.num_slots for s in free | self._used):
            raise AssertionError("a slot id is out of range")

    def close(self) -> None:
        """Unmaps the segment from this process; the segment itself stays until the owner unlinks it."""
        self._shm.close()

    def unlink(self) -> None:
        """Removes the segment name (owner only); processes that still map it keep their mapping until close."""
        self._require_owner("unlink")
        self._shm.unlink()

    def _require_owner(self, what: str) -> None:
        if not self._owner:
            raise RuntimeError(f"{what} needs the owning SlabPool (from create), not an attached one")


def new_segment_name(pid: int | None = None) -> str:
    """`radixserve_<pid>_<8 random hex>`, the pid defaulting to this process's."""
    return f"{SEGMENT_PREFIX}{os.getpid() if pid is None else pid}_{secrets.token_hex(4)}"


def segment_pid(name: str, prefix: str = SEGMENT_PREFIX) -> int | None:
    """The owner pid embedded in a segment name, or None when the name is not `<prefix><pid>_<tag>`."""
    pid, sep, _ = name.removeprefix(prefix).partition("_")
    return int(pid) if name.startswith(prefix) and sep and pid.isascii() and pid.isdigit() else None


def pid_alive(pid: int) -> bool:
    if pid <= 0:  # os.kill(0, ...) would signal our own process group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def cleanup_stale_segments(prefix: str = SEGMENT_PREFIX, live_pid_check: Callable[[int], bool] = pid_alive,
                           shm_dir: str = SHM_DIR) -> list[str]:
    """Unlinks the segments named `<prefix><pid>_<tag>` whose pid is not alive; returns their names.

    A reused pid keeps a stale segment alive (never the reverse). Returns [] where `shm_dir` does not exist.
    """
    removed = []
    names = os.listdir(shm_dir) if os.path.isdir(shm_dir) else []
    for name in names:
        pid = segment_pid(name, prefix)
        if pid is not None and not live_pid_check(pid):
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
            except (FileNotFoundError, PermissionError):  # another cleaner got there first; not ours to remove
                pass
    return removed


def _check_geometry(slot_bytes: int, num_slots: int) -> None:
    if slot_bytes < 1 or num_slots < 1:
        raise ValueError(f"slot_bytes and num_slots must be >= 1, got {slot_bytes} and {num_slots}")


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _attach_untracked(name: str) -> SharedMemory:
    # NOTE: before Python 3.13 attaching registers the segment with the resource tracker, which unlinks it when
    # this process exits, pulling the pool out from under the daemon that owns it. Unregister at once.
    if sys.version_info >= (3, 13):
        return SharedMemory(name, track=False)
    shm = SharedMemory(name)
    resource_tracker.unregister(shm._name, "shared_memory")
    return shm
