"""L2: the owner side of a slab pool in POSIX shared memory.

kvcached creates the segment and owns its free list (`SlabPool`); workers attach by name
(`radixserve.blocks.slab.SlabSegment`) and read or write slot bytes. The pool hands out slots and keeps each slot's
header (see `radixserve.blocks.slab`): `allocate` gives the slot a new generation and clears its key, `set_key`
names the block it holds once its bytes are in place. Which block a slot holds is the radix index's business; the
header lets a reader check it. `cleanup_stale_segments` removes the segments of dead daemons.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from multiprocessing.shared_memory import SharedMemory

from radixserve.blocks.slab import (
    EMPTY_KEY,
    HEADER,
    HEADER_BYTES,
    SEGMENT_PREFIX,
    SHM_DIR,
    SlabSegment,
    check_slab_geometry,
    create_segment,
    segment_bytes,
    segment_pid,
)


class SlabPool:
    """A segment this process created, with its free list. Not thread-safe.

    `segment` is the mapping (slot views, the whole buffer); the pool adds allocation, integrity and unlinking.
    """

    def __init__(self, shm: SharedMemory, slot_bytes: int, num_slots: int) -> None:
        """Use `create`."""
        self.segment = SlabSegment(shm, slot_bytes, num_slots)
        self._shm = shm
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: allocate pops the end
        self._used: set[int] = set()

    @classmethod
    def create(cls, name: str, slot_bytes: int, num_slots: int) -> SlabPool:
        """Creates the segment, zero-filled, and owns it; its pages are faulted in (and so committed) on a background
        thread (`SlabSegment.populate`). Raises FileExistsError when `name` exists, ValueError for
        a bad geometry or one larger than the free space of /dev/shm.

        NOTE: the segment is sparse, so creating it always succeeds; a write past a full /dev/shm (64 MB by default
        in Docker) would kill the writer with SIGBUS. Hence the free-space check here, once, up front.
        """
        check_slab_geometry(slot_bytes, num_slots)
        size = segment_bytes(slot_bytes, num_slots)
        if os.path.isdir(SHM_DIR) and _free_bytes(SHM_DIR) < size:
            raise ValueError(f"{SHM_DIR} has {_free_bytes(SHM_DIR)} bytes free, the pool needs {size}")
        pool = cls(create_segment(name, size), slot_bytes, num_slots)
        pool.segment.populate_in_background()
        return pool

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def num_slots(self) -> int:
        return self.segment.num_slots

    @property
    def slot_bytes(self) -> int:
        return self.segment.slot_bytes

    @property
    def num_free(self) -> int:
        return len(self._free)

    def view(self, slot: int) -> memoryview:
        return self.segment.view(slot)

    def generation(self, slot: int) -> int:
        return self.segment.generation(slot)

    def allocate(self, n: int) -> list[int]:
        """Takes up to `n` free slots (fewer when the pool runs short), each with a new generation and no key; the
        caller frees them."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        start = len(self._free) - min(n, len(self._free))
        taken = self._free[start:][::-1]
        del self._free[start:]
        self._used.update(taken)
        for slot in taken:
            HEADER.pack_into(self._shm.buf, slot * HEADER_BYTES, self.generation(slot) + 1, EMPTY_KEY)
        return taken

    def set_key(self, slot: int, key: bytes) -> None:
        """Names the block an allocated slot now holds (its bytes must already be in place)."""
        if slot not in self._used or len(key) != len(EMPTY_KEY):
            raise ValueError(f"slot {slot} is not allocated, or the key is not {len(EMPTY_KEY)} bytes")
        HEADER.pack_into(self._shm.buf, slot * HEADER_BYTES, self.generation(slot), key)

    def free(self, slots: Iterable[int]) -> None:
        """Returns allocated slots to the pool. Raises ValueError, freeing none, unless all are allocated and
        distinct. A freed slot may be handed out by the next `allocate`: stop using its views first."""
        slots = list(slots)
        if len(set(slots)) != len(slots) or not self._used.issuperset(slots):
            raise ValueError(f"can only free allocated slots, each once: {slots}")
        self._used.difference_update(slots)
        self._free.extend(slots)

    def check_integrity(self) -> None:
        """Raises AssertionError unless free and allocated slots partition the pool."""
        free = set(self._free)
        if len(free) != len(self._free) or free & self._used or len(free) + len(self._used) != self.num_slots:
            raise AssertionError(f"{len(self._free)} free + {len(self._used)} used != {self.num_slots} slots")
        if not all(0 <= s < self.num_slots for s in free | self._used):
            raise AssertionError("a slot id is out of range")

    def close(self) -> None:
        """Unmaps the segment from this process; the segment itself stays until `unlink`."""
        self.segment.close()

    def unlink(self) -> None:
        """Removes the segment name; processes that still map it keep their mapping until they close it."""
        self._shm.unlink()


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


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
