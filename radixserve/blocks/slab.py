"""The attach side of kvcached's L2: a slab segment of fixed-size slots in one POSIX shared-memory segment.

kvcached creates each segment, owns its free list and unlinks it (`kvcached.tiers.dram_shm.SlabPool`); a worker
attaches by name and reads or writes slot bytes. Which block a slot holds is the radix index's business.

Segment layout: a header per slot, then the slots, page-aligned:

    | header 0 | header 1 | ... | (pad to 4096) | slot 0 | slot 1 | ... |
    header: generation (u64, little-endian) | block key (16 bytes, zeros while the slot holds no cached block) | 8 spare

Only kvcached writes headers. The generation changes whenever the slot is allocated again, so a reader that sees the
same generation before and after copying a slot copied bytes nobody rewrote meanwhile (a seqlock), and the key says
which block those bytes are.

Segment names are `radixserve_<owner pid>_<8 hex>`, so a restarted daemon can remove the segments of a dead one.
NOTE: on Linux a segment is a file in /dev/shm and outlives its processes until someone unlinks it.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import struct
import sys
import threading
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import NamedTuple

from radixserve.priority import idle_current_thread

SEGMENT_PREFIX = "radixserve_"
SHM_DIR = "/dev/shm"
HEADER_BYTES = 32
HEADER = struct.Struct("<Q16s")  # generation, block key
GENERATION = struct.Struct("<Q")
DATA_ALIGN = 4096  # slots start on a page boundary: memmove and cudaHostRegister like it
EMPTY_KEY = bytes(16)


class SlotHeader(NamedTuple):
    generation: int
    key: bytes  # the block key of the cached block the slot holds; EMPTY_KEY while it holds none


def data_offset(num_slots: int) -> int:
    """Where slot 0 starts: after every slot's header, rounded up to a page."""
    return -(-num_slots * HEADER_BYTES // DATA_ALIGN) * DATA_ALIGN


def segment_bytes(slot_bytes: int, num_slots: int) -> int:
    return data_offset(num_slots) + slot_bytes * num_slots


class SlabSegment:
    """`num_slots` slots of `slot_bytes` bytes each, slot i at byte offset `i * slot_bytes`, mapped into this process.

    Views are memoryviews into the segment: release them (or drop them) before `close()`, which raises BufferError
    while any is alive. Closing never unlinks: the segment stays until its owner unlinks it.
    """

    def __init__(self, shm: SharedMemory, slot_bytes: int, num_slots: int) -> None:
        """Use `attach` (or `SlabPool.create` on the owner's side)."""
        check_slab_geometry(slot_bytes, num_slots)
        if shm.size < segment_bytes(slot_bytes, num_slots):
            shm.close()
            raise ValueError(f"segment {shm.name} holds {shm.size} bytes, not {num_slots} x {slot_bytes} and headers")
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self._shm = shm
        self._data = data_offset(num_slots)
        self._closed = False

    @classmethod
    def attach(cls, name: str, slot_bytes: int, num_slots: int) -> SlabSegment:
        """Maps an existing segment. Raises FileNotFoundError when `name` does not exist, ValueError when it is not
        kvcached's (see `is_segment_name`) or smaller than the geometry asks."""
        if not is_segment_name(name):
            raise ValueError(f"{name!r} is not a radixserve segment name")
        check_slab_geometry(slot_bytes, num_slots)
        return cls(_attach_untracked(name), slot_bytes, num_slots)

    @property
    def name(self) -> str:
        return self._shm.name

    @property
    def buffer(self) -> memoryview:
        """All slots as one memoryview, e.g. for `torch.frombuffer`; it counts as a view for `close()`."""
        return self._shm.buf[self._data:self._data + self.slot_bytes * self.num_slots]

    def view(self, slot: int) -> memoryview:
        """The bytes of `slot`, writable, shared with every process attached to the segment."""
        start = self._data + self._check(slot) * self.slot_bytes
        return self._shm.buf[start:start + self.slot_bytes]

    def header(self, slot: int) -> SlotHeader:
        return SlotHeader(*HEADER.unpack_from(self._shm.buf, self._check(slot) * HEADER_BYTES))

    def generation(self, slot: int) -> int:
        return GENERATION.unpack_from(self._shm.buf, self._check(slot) * HEADER_BYTES)[0]

    def _check(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.num_slots})")
        return slot

    def populate(self) -> bool:
        """Faults every page of this process's mapping in, writable, without changing a byte (Linux's
        MADV_POPULATE_WRITE, 5.14+), so that the first copy into or out of a slot runs at memory speed: a first touch
        costs a page fault per 4 KiB here, and reading L3 blocks into fresh slots ran at 0.4 GB/s against 2 GB/s into
        touched ones. On the owner's side it also commits the pool's memory up front. Works in `POPULATE_CHUNK_BYTES`
        steps with the GIL released (ctypes); False when the kernel cannot, or the segment was closed meanwhile."""
        # The address, without keeping an export of the buffer (that would make close() fail).
        address = ctypes.addressof(ctypes.c_char.from_buffer(self._shm.buf))
        size = self._shm.size
        for start in range(0, size, POPULATE_CHUNK_BYTES):
            length = min(POPULATE_CHUNK_BYTES, size - start)
            if self._closed or _libc.madvise(ctypes.c_void_p(address + start), length, _MADV_POPULATE_WRITE) != 0:
                return False
        return True

    def populate_in_background(self) -> threading.Thread:
        """`populate` on a daemon thread that runs only on idle cores (a 4 GiB pool takes seconds): slots are usable
        meanwhile, only slower. kvcached calls it for each pool it creates; a worker calls `populate` on its first
        segment only, and lets a later one fault in as it is used (docs/design.md section 4). At normal priority and in
        64 MiB steps, a restarted kvcached's new 1.6 GB segment, populated then by the daemon and by each worker that
        attached it, slowed the first L3 hit's forward from ~400 to 810-1,400 ms (that hit's TTFT 0.22-0.27x of cold in
        `bench.tiers`, against ~0.10x for the next)."""

        def populate_yielding() -> None:
            idle_current_thread()
            self.populate()

        thread = threading.Thread(target=populate_yielding, name=f"populate-{self.name}", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Unmaps the segment from this process."""
        self._closed = True
        self._shm.close()


# Per madvise call: a close() meanwhile stops `populate` within one chunk. With 64 MiB chunks, even on idle cores,
# the first hit after a kvcached restart ran its forward in 581 instead of ~400 ms while the segments populated (our
# guess: each call holds the process's memory-map lock, which the forward's allocations wait for); 2 MiB: 407 ms.
POPULATE_CHUNK_BYTES = 2 << 20
_MADV_POPULATE_WRITE = 23  # <linux/mman.h>
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def new_segment_name(pid: int | None = None) -> str:
    """`radixserve_<pid>_<8 random hex>`, the pid defaulting to this process's."""
    return f"{SEGMENT_PREFIX}{os.getpid() if pid is None else pid}_{secrets.token_hex(4)}"


def segment_pid(name: str, prefix: str = SEGMENT_PREFIX) -> int | None:
    """The owner pid embedded in a segment name, or None when the name is not `<prefix><pid>_<tag>`."""
    pid, sep, _ = name.removeprefix(prefix).partition("_")
    return int(pid) if name.startswith(prefix) and sep and pid.isascii() and pid.isdigit() else None


def is_segment_name(name: str) -> bool:
    """A name `new_segment_name` could have made: a worker maps nothing else."""
    return segment_pid(name) is not None and "/" not in name


def check_slab_geometry(slot_bytes: int, num_slots: int) -> None:
    if slot_bytes < 1 or num_slots < 1:
        raise ValueError(f"slot_bytes and num_slots must be >= 1, got {slot_bytes} and {num_slots}")


_created_here: set[str] = set()  # names of the segments this process created (`create_segment`)


def create_segment(name: str, size: int) -> SharedMemory:
    """Creates segment `name` of `size` bytes, owned (and unlinked at exit, if still there) by this process."""
    shm = SharedMemory(name, create=True, size=size)
    _created_here.add(name)
    return shm


def _attach_untracked(name: str) -> SharedMemory:
    # NOTE: before Python 3.13 attaching registers the segment with the resource tracker, which unlinks it when
    # this process exits, pulling the pool out from under the daemon that owns it. Unregister at once, unless this
    # process created it (a benchmark or test in one process): the tracker keeps one entry a name, which is the
    # creator's, and its unlink unregisters it (a second unregister prints a KeyError traceback from the tracker).
    # Not the pid in the name: containers sharing /dev/shm have pid namespaces of their own, where pids repeat.
    if sys.version_info >= (3, 13):
        return SharedMemory(name, track=False)
    shm = SharedMemory(name)
    if name not in _created_here:
        resource_tracker.unregister(shm._name, "shared_memory")
    return shm
