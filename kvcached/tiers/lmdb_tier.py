"""L3: a size-bounded, LRU-evicted block store in one LMDB environment on local disk.

One LMDB value holds one block: a header, the namespace (model fingerprint) and the block's bytes, under its
16-byte chained block hash (`radixserve.blocks.keys`). The header carries the parent hash, so the daemon can rebuild its
radix index from `scan()` alone after a restart (a block is usable only if its whole chain to the root is present).

    value = magic "RSL3" | version u16 | ns_len u16 | payload_len u64 | xxh3 u64 | parent_hash 16B | ns | payload
    the checksum covers key + header (its field zeroed) + ns + payload, so a value under the wrong key also fails.

Checksum: XXH3-64 ran at 12 GB/s on 0.74 MB blocks here, zlib.crc32 at 1.2-2.3 GB/s (it capped L3 reads at
2.3 GB/s against 8.8 for the raw bytes), BLAKE2b-64 at 0.57 GB/s. A checksum only has to catch torn or rotted bytes,
not an adversary, so XXH3.

Threads and contracts
- NOTE: LMDB allows one writer. Every write transaction (puts, evictions, deletion of corrupt blocks, namespace
  drops) runs on the tier's own writer thread. It takes up to `max_batch_blocks` / `max_batch_bytes` of queued puts
  at a time (by default 16 blocks / 16 MiB), waits once for a quiet spell (`_await_quiet`), then commits each block in
  its own txn. The writer runs at SCHED_IDLE (`_run`), but a thread inside a system call is not preempted here (the
  kernel is `PREEMPT_NONE`), and the scheduler places a woken thread on a core that runs only SCHED_IDLE work as if it
  were idle: the woken thread (a request's, or the forward's) waits there until the writer's commit (its writev, then
  its fdatasync) returns, so commits stay one block long. Wakeups onto the writer's core during the peers' first three
  workloads through one stack waited 0.57 ms median, 6.7 ms p90, 12.4 ms at most and 570 ms in all (sum of those
  over 1 ms) with the batch in one txn; 0.005, 0.04, 7.3 and 33 ms with a txn per block (2026-12-07 21:00). One
  writer into a growing environment stored 840-930 MB/s with one block a txn against 250-420 with 16. One block a
  *batch* (so a quiet wait before every block) was tried and reverted (docs/design.md section 9). On the Xeon VM of
  2026-12-05 the commits' syncs slowed the worker beside them: no-reuse throughput with the cache on was 0.93-0.94x
  of cache off with 4 blocks a txn (3 alternating runs) against 0.96-0.98x with 16; on this host the make bench
  serving runs with a txn per block had 0.97x (21:00).
- `put_async` never blocks: it queues the block, or drops it and counts `dropped_writes` when the queue holds
  `max_queue_bytes` already. The writer stores queued blocks once no request has used the cache for `QUIET_S`
  (`note_request`), on idle cores, unless urged (`urge`: L2 evicted a queued block) or its backlog grows urgent. A
  block already stored is not rewritten (equal keys mean equal contents). The block comes as bytes or as a
  `BlockSource` (an L2 slot), which the writer copies from when it stores the block, into one reusable buffer:
  nothing copies on the caller's thread. A source that no longer holds the block by then (its slot was reused), or
  whose copy raises, is a dropped write.
- `get` / `read_into` may run on any thread, concurrently. They return a miss (None / False) for an absent block, a
  block that fails its checksum (counted in `corrupt_blocks`, then deleted by the writer) and any I/O error (the tier
  turns unhealthy; nothing is raised). What they return is a copy: it stays valid after the call.
- `flush` returns once everything queued before it is committed and synced; `close` flushes, then stops the writer.
- `take_events` drains the STORED / REMOVED events since the last call, in commit order, so the daemon can keep
  its index in step with evictions; they accumulate until taken. A queued block whose write the writer drops (larger
  than the budget, map still full after evicting, an I/O error) gets a REMOVED event too: the daemon counts a block
  as stored once `put_async` accepts it, and must not match it afterwards (a void source is such a drop).
- `check_integrity()` (tests, idle daemon): the keys in LMDB are exactly the tracked blocks plus those awaiting
  deletion, and `bytes_used` is the sum of their stored sizes.

Size bound: `bytes_used` counts stored values (header + ns + payload, see `stored_bytes`); before each batch the
writer evicts least-recently-used blocks until the batch fits in `budget_bytes`. LRU order lives in memory only (an
OrderedDict touched by reads): persisting it would cost a write per read. After a reopen, every stored block counts
as older than any block touched since, in key order (hash order: effectively random). `map_size` leaves headroom for
LMDB's page overhead and for pages freed by the last txns that are not reusable yet; if the map still fills
(MapFullError) the writer evicts the worth of the batch's blocks not yet stored and retries them once, then drops
those still left and counts them.

Durability: `sync=True, metasync=False` (MDB_NOMETASYNC). Each commit fdatasyncs its data pages; the meta page goes
to disk with the next commit or `flush`. A kill -9 loses only what was not committed (committed pages sit in the page
cache); a system crash may undo the last commit but cannot corrupt the environment (LMDB's documented guarantee for
this flag), so it always reopens. `sync=False` was ~25% faster but lets a system crash corrupt the whole file;
`writemap` gave no speed-up and lets a stray in-process write corrupt the map. A block that still fails its checksum
is a miss, never served.

Files: the blocks are KV caches of users' prompts, so the environment is private to the daemon's user. Its directory
is created 0700, and an existing one with group or other bits is tightened to 0700; when the daemon does not own it,
that chmod fails and the tier does not open (DiskTierError, like an unwritable path: the daemon exits, or runs
without L3 under --disk-cache-optional). LMDB creates data.mdb and lock.mdb 0600 (`mode`, less the umask). An
environment made before this keeps its files' 0644, behind the now private directory.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple, Protocol, TypeVar

import lmdb
import numpy as np
import xxhash

from radixserve.blocks.keys import DIGEST_BYTES, BlockHash
from radixserve.priority import can_leave_idle, idle_current_thread, lower_current_thread_priority, normal_thread

log = logging.getLogger("kvcached.tiers.lmdb")

ROOT_PARENT = BlockHash(bytes(DIGEST_BYTES))  # the parent hash stored for page 0 (keys.py's h_{-1})
MAGIC = b"RSL3"
FORMAT_VERSION = 2  # 1 had a crc32; its blocks now fail the header check and are dropped like corrupt ones
_HEAD = struct.Struct("<4sHHQQ16s")  # magic, version, ns_len, payload_len, xxh3_64, parent_hash
_MAX_NS = 0xFFFF
_T = TypeVar("_T")


class DiskTierError(OSError):
    """The environment at a path cannot be opened or created; the message names the path and the reason."""


class BlockMeta(NamedTuple):
    hash: BlockHash
    parent_hash: BlockHash  # ROOT_PARENT for the first page of a prompt
    namespace: str
    nbytes: int  # payload bytes (the block), without the header


class EventKind(str, Enum):
    STORED = "stored"
    REMOVED = "removed"  # evicted, corrupt, dropped with its namespace, or its queued write was dropped


class TierEvent(NamedTuple):
    kind: EventKind
    block_hash: BlockHash


@dataclass(frozen=True)
class DiskTierStats:
    bytes_used: int
    bytes_total: int  # the budget
    blocks: int
    queued_bytes: int
    reads: int  # hits served by get / read_into
    misses: int
    bytes_read: int
    writes: int  # blocks committed
    bytes_written: int
    corrupt_blocks: int
    dropped_writes: int
    evictions: int
    io_errors: int
    healthy: bool


def stored_bytes(namespace: str, payload_len: int) -> int:
    """What one block counts against the budget: header + namespace + payload."""
    return _stored_size(namespace.encode(), payload_len)


def _stored_size(namespace: bytes, payload_len: int) -> int:
    return _HEAD.size + len(namespace) + payload_len


class BlockSource(Protocol):
    """A block's bytes, read when the writer stores the block rather than when it is queued: `copy_into` runs on the
    writer's thread, possibly twice (a batch retried after a full map), and whatever it reads must stay open until
    the tier is flushed or closed."""

    nbytes: int

    def copy_into(self, out: memoryview) -> bool:
        """Copies the block's `nbytes` bytes into `out`; False when the source no longer holds the block (then
        `out` holds nothing usable)."""


class _Bytes(NamedTuple):
    """A block already copied out, e.g. from an L2 slot about to be reused."""

    payload: bytes

    @property
    def nbytes(self) -> int:
        return len(self.payload)

    def copy_into(self, out: memoryview) -> bool:
        copy_bytes(out, self.payload)
        return True


class _Put(NamedTuple):
    key: bytes
    parent: bytes
    namespace: bytes
    source: BlockSource


class _Barrier(NamedTuple):
    done: threading.Event


class _DropNamespace(NamedTuple):
    namespace: bytes
    result: Future


URGE_S = 1.0  # how long the writer stays off idle cores after `urge`
QUIET_S = 0.3  # how long the writer holds its next batch after a request used the cache (`note_request`)
_WAKE = object()  # a corrupt block awaits deletion
_STOP = object()


class DiskTier:
    """See the module docstring. Opening reads every header once to rebuild sizes and the LRU set."""

    def __init__(self, path: str | os.PathLike, budget_bytes: int, *, max_queue_bytes: int = 1 << 30,
                 max_batch_blocks: int = 16, max_batch_bytes: int = 16 << 20, map_size: int | None = None,
                 read_delay_s: float = 0.0) -> None:
        """Opens (creating if needed) the environment in directory `path`. Raises ValueError for a non-positive
        budget or batch limit, DiskTierError when the path cannot hold an environment. `map_size` overrides the
        derived map size (tests use it to fill the map); `read_delay_s` sleeps in every read (tests only). The
        writer leaves idle cores for normal priority at a backlog of three quarters of `max_queue_bytes`, or when
        urged (`urge`, `_run`)."""
        if min(budget_bytes, max_batch_blocks, max_batch_bytes, max_queue_bytes) <= 0:
            raise ValueError("budget_bytes, max_queue_bytes and the batch limits must be positive")
        self.path = os.fspath(path)
        self._budget = budget_bytes
        self._max_queue = max_queue_bytes
        self._urgent_bytes = max_queue_bytes * 3 // 4  # near the bound, where writes would start to drop
        self._batch_limits = (max_batch_blocks, max_batch_bytes)
        self._read_delay = read_delay_s
        # headroom: LMDB page overhead, and the pages of the last txns that are freed but not yet reusable
        self._env = _open_env(self.path, map_size or budget_bytes + budget_bytes // 8 + 2 * max_batch_bytes + (1 << 20))
        self._lock = threading.Lock()  # guards everything below, shared by readers and the writer
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # key -> stored size, least recently used first
        self._doomed: dict[bytes, int] = {}  # corrupt keys the writer must delete -> stored size
        self._events: list[TierEvent] = []
        self._bytes_used = self._queued = 0
        self._urged_until = 0.0  # monotonic; the writer's, set by `urge` on any thread
        self._may_idle = can_leave_idle()
        self._nice = os.getpriority(os.PRIO_PROCESS, 0)  # the daemon's: what urgent writes run at
        # the writer's last choice was SCHED_IDLE (its first will be, unless urgent); only the writer sets it
        self._writer_idle = self._may_idle
        self._quiet_at = 0.0  # monotonic; set by `note_request`
        self._wake = threading.Event()  # ends the writer's wait for quiet early: an urge, a flush, close
        self._flushes_pending = 0  # flushes whose barrier the writer has not reached: no put waits for quiet meanwhile
        self._counts = dict.fromkeys(("reads", "misses", "bytes_read", "writes", "bytes_written", "corrupt_blocks",
                                      "dropped_writes", "evictions", "io_errors"), 0)
        self._healthy, self._closed = True, False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._buffer = bytearray()  # the writer's: each value is encoded here, then copied by LMDB
        try:
            self._load()
        except lmdb.Error as exc:
            self._env.close()
            raise DiskTierError(f"cannot read the L3 disk tier at {self.path}: {exc}") from exc
        self._writer = threading.Thread(target=self._run, name="lmdb-tier-writer", daemon=True)
        self._writer.start()

    # ---- request path -------------------------------------------------------------------------------------------

    def put_async(self, namespace: str, block_hash: BlockHash, parent_hash: BlockHash,
                  payload: bytes | bytearray | memoryview | BlockSource) -> bool:
        """Queues one block for writing; never blocks. False when it was dropped (queue full or tier closed).
        The tier keeps a reference to `payload`. Raises ValueError for a malformed hash or namespace."""
        source = _Bytes(bytes(payload)) if isinstance(payload, (bytes, bytearray, memoryview)) else payload
        ns = namespace.encode()
        if len(block_hash) != DIGEST_BYTES or len(parent_hash) != DIGEST_BYTES or len(ns) > _MAX_NS:
            raise ValueError(f"hashes must be {DIGEST_BYTES} bytes and the namespace at most {_MAX_NS}")
        with self._lock:
            if block_hash in self._lru:
                self._lru.move_to_end(block_hash)
                return True
            if self._closed or self._queued + source.nbytes > self._max_queue:
                self._counts["dropped_writes"] += 1
                return False
            self._queued += source.nbytes
            # only the put that crosses the bound: the writer goes idle again only at or below it (`_urgent`)
            crossed = self._queued - source.nbytes <= self._urgent_bytes < self._queued
        if crossed:
            self._leave_idle()
        self._queue.put(_Put(bytes(block_hash), bytes(parent_hash), ns, source))
        return True

    def get(self, block_hash: BlockHash) -> bytes | None:
        """The block's bytes, or None on a miss (absent, corrupt, I/O error). Refreshes LRU order on a hit."""
        return self._read(block_hash, bytes)

    def read_into(self, block_hash: BlockHash, out: memoryview) -> bool:
        """Copies the block's bytes into `out[:nbytes]` (a byte memoryview, e.g. an L2 slot) and returns True, or
        returns False on a miss with `out` untouched. Raises ValueError when `out` is shorter than the block."""
        return self._read(block_hash, lambda payload: _copy_into(out, payload)) is not None

    def contains(self, block_hash: BlockHash) -> bool:
        """Whether the block is stored and not known to be corrupt; touches nothing."""
        with self._lock:
            return block_hash in self._lru

    # ---- control ------------------------------------------------------------------------------------------------

    def note_request(self) -> None:
        """A request used the cache just now: the writer holds its next batch of puts until none has for `QUIET_S`
        (`_await_quiet`)."""
        self._quiet_at = time.monotonic() + QUIET_S

    def urge(self) -> None:
        """Some queued block has lost its other copy (L2 evicted it, and its bytes wait in memory until written): the
        writer leaves idle cores for normal priority at once, whatever its backlog, and stops waiting for quiet, for
        the next `URGE_S` seconds."""
        self._urged_until = time.monotonic() + URGE_S
        self._leave_idle()
        self._wake.set()

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every block queued before this call is committed and synced. False on timeout."""
        if self._closed:
            return True
        barrier = _Barrier(threading.Event())
        with self._lock:
            self._flushes_pending += 1
        self._wake.set()
        self._queue.put(barrier)
        return barrier.done.wait(timeout)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Flushes, stops the writer and closes the environment; later puts are dropped, reads miss. False when the
        writer did not finish in time (the environment is then left open for it). Idempotent."""
        with self._lock:
            if self._closed:
                return True
            self._closed = True
        self._wake.set()
        self._queue.put(_STOP)
        self._writer.join(timeout)
        if self._writer.is_alive():
            log.warning("disk tier writer still busy; not closing the environment",
                        extra={"path": self.path, "timeout_s": timeout})
            return False
        self._env.close()
        return True

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def scan(self) -> Iterator[BlockMeta]:
        """Every stored block with a well-formed header, in key order. Reads headers only (one page per block);
        payloads are verified when read. Runs in one read txn, so it sees one consistent snapshot."""
        with self._env.begin(buffers=True) as txn:
            metas = [m for m in (_meta(bytes(k), v) for k, v in txn.cursor()) if m is not None]
        return iter(metas)

    def delete_namespace(self, namespace: str, timeout: float | None = 60.0) -> int:
        """Deletes every block of `namespace` (blocks queued before the call included) and returns how many.
        An operator command: it waits for the writer. Raises TimeoutError, or DiskTierError when closed or on an
        I/O error."""
        if self._closed:
            raise DiskTierError(f"the L3 disk tier at {self.path} is closed")
        op = _DropNamespace(namespace.encode(), Future())
        self._queue.put(op)
        return op.result.result(timeout)

    def take_events(self) -> list[TierEvent]:
        """STORED / REMOVED events since the last call, in commit order; clears them."""
        with self._lock:
            events, self._events = self._events, []
        return events

    @property
    def healthy(self) -> bool:
        """False after the first run-time I/O error, until the tier is reopened."""
        return self._healthy

    def stats(self) -> DiskTierStats:
        with self._lock:
            return DiskTierStats(bytes_used=self._bytes_used, bytes_total=self._budget, blocks=len(self._lru),
                                 queued_bytes=self._queued, healthy=self._healthy, **self._counts)

    def check_integrity(self) -> None:
        """Raises AssertionError unless LMDB's keys are the tracked plus the doomed blocks and `bytes_used` their sum.
        Call it when no write is in flight (after `flush`)."""
        with self._env.begin(buffers=True) as txn, self._lock:
            on_disk = {bytes(k): len(v) for k, v in txn.cursor()}
            tracked = {**self._lru, **self._doomed}
            if on_disk != tracked:
                raise AssertionError(f"{len(on_disk)} blocks in LMDB, {len(tracked)} tracked, or sizes disagree")
            if sum(tracked.values()) != self._bytes_used:
                raise AssertionError(f"bytes_used {self._bytes_used} != {sum(tracked.values())} stored")

    # ---- reads --------------------------------------------------------------------------------------------------

    def _read(self, key: bytes, sink: Callable[[memoryview], _T]) -> _T | None:
        if not self._touch(key):
            return None
        if self._read_delay:
            time.sleep(self._read_delay)
        try:
            with self._env.begin(buffers=True) as txn:
                value = txn.get(key)
                payload = None if value is None else _verified(key, value)
                result = None if payload is None else sink(payload)
                nbytes = None if payload is None else len(payload)
        except lmdb.Error as exc:
            self._fault("read", exc)
            return None
        self._count_read(key, value is not None, nbytes)
        return result

    def _touch(self, key: bytes) -> bool:
        with self._lock:
            if key in self._lru and not self._closed:
                self._lru.move_to_end(key)
                return True
            self._counts["misses"] += 1
            return False

    def _count_read(self, key: bytes, found: bool, nbytes: int | None) -> None:
        """A hit when `nbytes` is set; a block `found` without it failed verification and is doomed."""
        with self._lock:
            if nbytes is not None:
                self._counts["reads"] += 1
                self._counts["bytes_read"] += nbytes
                return
            self._counts["misses"] += 1
            if not found or key not in self._lru:  # evicted, or doomed by another reader, since the touch
                return
            self._counts["corrupt_blocks"] += 1
            self._doomed[key] = self._lru.pop(key)
            self._events.append(TierEvent(EventKind.REMOVED, BlockHash(key)))
        self._queue.put(_WAKE)

    # ---- writer thread ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        """The writer loop: each pass drains a batch of queued ops and applies them; exits after _STOP. No request
        waits for a write, and a queued block is also in L2 until L2 evicts it, so the writer runs on idle cores only
        (SCHED_IDLE) unless its work turns urgent: some queued block has lost that copy (`urge`: L2 evicted it, and
        until it is written it exists only in memory, where a revisit cannot find it) or the backlog passes
        `_urgent_bytes` (three quarters of the queue's bound, where writes would start to drop). Then it runs at
        normal priority, at the daemon's nice, until the urge lapses and the backlog halves. Otherwise a batch of
        puts also waits for a quiet spell (`_await_quiet`). Where the thread could not leave SCHED_IDLE again
        (`can_leave_idle`), it runs at `BACKGROUND_NICE` all along.

        Urgent writes ran at nice 10 until 2026-12-07, switched by the writer at its next batch: beside a revisit's
        forwards each commit then took 2.7 ms median, 35 ms p90 and up to 1.4 s, at SCHED_IDLE up to 1.1 s; 2-35
        blocks a second were stored against ~80 committed, a revisited document was still queued, and `make bench`'s
        revisit took 0-0.053 of its prompt tokens from L3 under `timeout` (9 runs). At nice 0, switched at once by
        the urging thread (`_leave_idle`): 0.195 in 2 of 2 runs, all that L3 can serve there (docs/design.md
        section 9). Idle cores matter where the work is not urgent: the no-reuse workload, 3 runs of 8 requests of
        256 tokens, alternating: decode steps 16.2-16.9 ms (median) idle against 19.0-20.3 at nice 10."""
        if not self._may_idle:
            lower_current_thread_priority()
        while True:
            ops = self._drain()
            if all(isinstance(op, _Put) for op in ops):
                self._await_quiet()
            self._choose_priority()
            try:
                self._apply(ops)
            except Exception as exc:  # never let the writer die: barriers and later writes still need it
                self._fault("write", exc)
            finally:
                for op in ops:
                    if isinstance(op, _Barrier):
                        with self._lock:
                            self._flushes_pending -= 1
                        op.done.set()
            if ops[-1] is _STOP:
                self._writer_idle = False  # nothing may change this thread's priority once it is gone
                return

    def _await_quiet(self) -> None:
        """Holds the writer's batch of puts until no request has used the cache for `QUIET_S`, unless the writer is
        urged, its backlog is past `_urgent_bytes`, a flush waits or the tier closes: a queued block is still in L2,
        and its write beside a request slowed it (the shared-prefix workload's hits, 3 alternating runs: TTFT
        [72, 72, 59, 59], [69, 62, 80, 80], [65, 68, 51, 51] ms with the writes, [53, 51, 57, 56], [60, 58, 71, 66],
        [53, 51, 56, 55] without; docs/design.md section 9). A flush, an urge or close ends the wait: each sets its
        state before `_wake`, so the event can be cleared here first and only ends a wait early."""
        self._wake.clear()
        while not (self._closed or self._flushes_pending or self._urged() or self._queued > self._urgent_bytes):
            remaining = self._quiet_at - time.monotonic()
            if remaining <= 0:
                return
            self._wake.wait(remaining)

    def _urged(self) -> bool:
        return time.monotonic() < self._urged_until

    def _urgent(self) -> bool:
        """Whether the writer's work is urgent: urged, or a backlog past `_urgent_bytes` (past half of it while the
        writer is off idle cores already, so that it does not flip at the bound)."""
        limit = self._urgent_bytes if self._writer_idle else self._urgent_bytes // 2
        return self._urged() or self._queued > limit

    def _choose_priority(self) -> None:
        """The writer, before each batch: SCHED_IDLE unless its work is urgent, else normal priority at the daemon's
        nice. Set every batch, since `_leave_idle` may have moved it meanwhile. `_writer_idle` is set before the
        thread goes idle and urgency is read again after, so an urge racing with this call always ends with the
        writer at normal priority, without a lock: a SCHED_IDLE thread preempted while holding one would stall
        whoever waits for it until a core idles."""
        if not self._may_idle:
            return
        if not self._urgent():
            self._writer_idle = True
            idle_current_thread()
            if not self._urgent():
                return
        normal_thread(nice=self._nice)
        self._writer_idle = False  # after the move: an urge meanwhile still moves it

    def _leave_idle(self) -> None:
        """The writer's work turned urgent (any thread, after setting what made it so): the writer leaves SCHED_IDLE
        now, not at its next batch. Inside a commit beside busy cores, a SCHED_IDLE writer took up to 1.1 s to return
        (the kernel is `PREEMPT_NONE`, but a sync sleeps, and the woken thread waits for an idle core)."""
        if self._writer_idle:
            normal_thread(self._writer.native_id, self._nice)

    def _drain(self) -> list:
        """The next batch: blocks for one op, then takes what is queued, up to the batch limits or a _STOP."""
        ops = [self._queue.get()]
        max_blocks, max_bytes = self._batch_limits
        nbytes = _put_bytes(ops[-1])
        while ops[-1] is not _STOP and len(ops) < max_blocks and nbytes < max_bytes:
            try:
                ops.append(self._queue.get_nowait())
            except queue.Empty:
                break
            nbytes += _put_bytes(ops[-1])
        return ops

    def _apply(self, ops: list) -> None:
        """Corrupt blocks go first (a put may re-store one), then the puts, so that the batch's barriers and
        namespace drops see them."""
        puts = [op for op in ops if isinstance(op, _Put)]
        with self._lock:
            self._queued -= sum(p.source.nbytes for p in puts)
            doomed = list(self._doomed)
        self._delete(doomed)
        self._write(puts)
        for op in ops:
            if isinstance(op, _DropNamespace):
                self._drop_namespace(op)
        if ops[-1] is _STOP or any(isinstance(op, _Barrier) for op in ops):
            self._env.sync(True)

    def _write(self, puts: list[_Put]) -> None:
        """Stores the batch's fresh puts, one txn each (module docstring: short commits keep woken threads off the
        writer's core only briefly). When the map fills, the puts left evict their worth once more and are retried
        once; those that still do not fit are dropped."""
        fresh = self._fresh(puts)
        if not fresh:
            return
        self._evict(self._bytes_used + sum(_put_size(p) for p in fresh) - self._budget)
        unstored = self._put_each(fresh)
        if unstored:
            self._evict(sum(_put_size(p) for p in unstored))
            unstored = self._put_each(unstored)
        if unstored:
            log.warning("disk tier map full after evicting; dropping blocks",
                        extra={"path": self.path, "blocks": len(unstored)})
            self._drop([p.key for p in unstored])

    def _fresh(self, puts: list[_Put]) -> list[_Put]:
        """The puts not stored yet, each key once; blocks larger than the budget are dropped."""
        with self._lock:
            new = list({p.key: p for p in puts if p.key not in self._lru}.values())
        self._drop([p.key for p in new if _put_size(p) > self._budget])
        return [p for p in new if _put_size(p) <= self._budget]

    def _put_each(self, puts: list[_Put]) -> list[_Put]:
        """Stores `puts` in order, each in its own txn, and returns those left when the map filled (from the first
        that did not fit). An I/O error drops the rest; a put whose source no longer holds its block is dropped."""
        for i, put in enumerate(puts):
            value = self._encode(put)
            if value is None:
                self._drop([put.key])
                continue
            try:
                with self._env.begin(write=True) as txn:
                    txn.put(put.key, value)
            except lmdb.MapFullError:
                return puts[i:]
            except lmdb.Error as exc:
                self._fault("write", exc)
                self._drop([p.key for p in puts[i:]])
                return []
            with self._lock:
                self._bytes_used += len(value) - self._doomed.pop(put.key, 0)  # doomed meanwhile: overwritten
                self._lru[put.key] = len(value)
                self._events.append(TierEvent(EventKind.STORED, BlockHash(put.key)))
                self._counts["writes"] += 1
                self._counts["bytes_written"] += len(value)
        return []

    def _encode(self, put: _Put) -> memoryview | None:
        """The value stored for `put` (layout: module docstring), written into the writer's buffer and valid until
        the next call; None when its source no longer holds the block."""
        start, end = _HEAD.size + len(put.namespace), _put_size(put)
        if len(self._buffer) < end:
            self._buffer = bytearray(end)
        value = memoryview(self._buffer)[:end]
        try:
            copied = put.source.copy_into(value[start:])
        except Exception as exc:  # e.g. its pool closed under a writer that outlived close()'s timeout
            log.warning("disk tier could not read a queued block; dropping it", extra={"error": repr(exc)[:300]})
            copied = False
        if not copied:
            return None
        value[_HEAD.size:start] = put.namespace
        fields = (MAGIC, FORMAT_VERSION, len(put.namespace), put.source.nbytes)
        _HEAD.pack_into(value, 0, *fields, 0, put.parent)  # the checksum covers its own field zeroed
        _HEAD.pack_into(value, 0, *fields, _checksum((put.key, value)), put.parent)
        return value

    def _evict(self, nbytes: int) -> None:
        """Deletes least-recently-used blocks until at least `nbytes` stored bytes are gone (or none are left)."""
        victims: list[bytes] = []
        with self._lock:
            for key, size in self._lru.items():
                if nbytes <= 0:
                    break
                victims.append(key)
                nbytes -= size
        self._delete(victims, evicted=True)

    def _delete(self, keys: list[bytes], evicted: bool = False) -> None:
        """Deletes `keys` in one txn and forgets them, with a REMOVED event for each one still tracked."""
        if not keys:
            return
        try:
            with self._env.begin(write=True) as txn:
                for key in keys:
                    txn.delete(key)
        except lmdb.Error as exc:
            self._fault("delete", exc)
            return
        with self._lock:
            for key in keys:
                was_tracked = key in self._lru
                self._bytes_used -= self._lru.pop(key, 0) + self._doomed.pop(key, 0)
                if was_tracked:
                    self._events.append(TierEvent(EventKind.REMOVED, BlockHash(key)))
            self._counts["evictions"] += len(keys) if evicted else 0

    def _drop_namespace(self, op: _DropNamespace) -> None:
        ns = op.namespace.decode()
        try:
            keys = [m.hash for m in self.scan() if m.namespace == ns]
        except lmdb.Error as exc:
            self._fault("scan", exc)
            op.result.set_exception(DiskTierError(f"{self.path}: scan failed: {exc}"))
            return
        self._delete(keys)
        op.result.set_result(len(keys))

    # ---- shared -------------------------------------------------------------------------------------------------

    def _load(self) -> None:
        """Rebuilds sizes and the LRU set from the stored headers; malformed ones are doomed for the writer."""
        with self._env.begin(buffers=True) as txn:
            for key, value in txn.cursor():
                target = self._lru if _meta(bytes(key), value) else self._doomed
                target[bytes(key)] = len(value)
        self._bytes_used = sum(self._lru.values()) + sum(self._doomed.values())
        self._counts["corrupt_blocks"] = len(self._doomed)
        if self._doomed:
            self._queue.put(_WAKE)

    def _fault(self, what: str, exc: BaseException) -> None:
        log.error("disk tier operation failed; the tier turns unhealthy",
                  extra={"path": self.path, "op": what, "error": str(exc)})
        with self._lock:
            self._healthy = False
            self._counts["io_errors"] += 1

    def _drop(self, keys: list[bytes]) -> None:
        """Counts queued writes that will not land, with a REMOVED event each (see `take_events`)."""
        with self._lock:
            self._counts["dropped_writes"] += len(keys)
            self._events.extend(TierEvent(EventKind.REMOVED, BlockHash(key)) for key in keys)


def _open_env(path: str, map_size: int) -> lmdb.Environment:
    """The environment in `path`, made private first (see "Files" in the module docstring)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        if os.stat(path).st_mode & 0o077:
            os.chmod(path, 0o700)  # fails (EPERM) unless this user owns the directory: then the tier does not open
        if not os.access(path, os.W_OK):
            raise PermissionError("directory is not writable")
        return lmdb.open(path, map_size=map_size, max_dbs=0, sync=True, metasync=False, meminit=False,
                         max_readers=256, mode=0o600)
    except (OSError, lmdb.Error) as exc:
        raise DiskTierError(f"cannot open the L3 disk tier at {path}: {exc}") from exc


def _put_bytes(op: object) -> int:
    return op.source.nbytes if isinstance(op, _Put) else 0


def _put_size(put: _Put) -> int:
    return _stored_size(put.namespace, put.source.nbytes)


def _checksum(parts: Iterable[bytes | memoryview]) -> int:
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    return digest.intdigest()


def _header(value: memoryview) -> tuple[int, int, int, bytes] | None:
    """(ns_len, payload_len, checksum, parent) when `value` starts with a well-formed header of its own length."""
    if len(value) < _HEAD.size:
        return None
    magic, version, ns_len, payload_len, checksum, parent = _HEAD.unpack_from(value)
    if magic != MAGIC or version != FORMAT_VERSION or _HEAD.size + ns_len + payload_len != len(value):
        return None
    return ns_len, payload_len, checksum, parent


def _meta(key: bytes, value: memoryview) -> BlockMeta | None:
    head = _header(value)
    if head is None or len(key) != DIGEST_BYTES:
        return None
    ns_len, payload_len, _, parent = head
    try:
        ns = bytes(value[_HEAD.size:_HEAD.size + ns_len]).decode()
    except UnicodeDecodeError:
        return None
    return BlockMeta(BlockHash(key), BlockHash(parent), ns, payload_len)


def _verified(key: bytes, value: memoryview) -> memoryview | None:
    """The payload of `value` (a view, valid inside the read txn) when header and checksum hold, else None."""
    head = _header(value)
    if head is None:
        return None
    ns_len, payload_len, checksum, parent = head
    zeroed = _HEAD.pack(MAGIC, FORMAT_VERSION, ns_len, payload_len, 0, parent)
    start = _HEAD.size + ns_len
    ns, payload = value[_HEAD.size:start], value[start:]
    return payload if _checksum((key, zeroed, ns, payload)) == checksum else None


def _copy_into(out: memoryview, payload: memoryview) -> bool:
    if len(out) < len(payload):
        raise ValueError(f"buffer of {len(out)} bytes cannot hold a {len(payload)}-byte block")
    copy_bytes(out[:len(payload)], payload)
    return True


def copy_bytes(out: memoryview, source: bytes | memoryview) -> None:
    """out[:] = source (the same length) with the GIL released: numpy's copy, where a memoryview slice assignment
    holds it. So the prefetch pool's threads read blocks in parallel (118 blocks in 15 ms on 2 threads against 25 ms
    on one, design section 4), and the L3 writer, on idle cores only, never holds the GIL through a block's copy: a
    SCHED_IDLE thread preempted while holding it stalls the daemon's event loop (MatchPrefix) until a core idles,
    which on 2 cores busy with a forward is its end."""
    np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(source, np.uint8))
