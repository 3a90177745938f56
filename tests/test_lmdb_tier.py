import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import lmdb
import pytest

from kvcached.tiers.lmdb_tier import (
    BlockMeta,
    DiskTier,
    DiskTierError,
    EventKind,
    TierEvent,
    stored_bytes,
)
from kvcached.tiers import lmdb_tier
from radixserve.launch import wait_for
from radixserve.priority import can_leave_idle
from tests.kvcache_helpers import NS, N, key, parent, payload

OTHER = "fp-b"
SIZE = stored_bytes(NS, N)


def put(tier: DiskTier, *ids: int, ns: str = NS, n: int = N) -> None:
    for i in ids:
        assert tier.put_async(ns, key(i), parent(i), payload(i, n))
    assert tier.flush(timeout=10)


def stored(tier: DiskTier) -> set[int]:
    return {int.from_bytes(m.hash, "big") - 1 for m in tier.scan()}


@pytest.fixture
def tier(tmp_path):
    tier = DiskTier(tmp_path / "l3", budget_bytes=1 << 20)
    yield tier
    assert tier.flush(timeout=10)
    tier.check_integrity()
    tier.close()


def test_round_trip_counts_and_events(tier):
    put(tier, 0, 1, 2)
    assert [tier.get(key(i)) for i in range(3)] == [payload(i) for i in range(3)]
    assert tier.get(key(9)) is None
    s = tier.stats()
    assert (s.blocks, s.bytes_used, s.writes, s.reads, s.misses, s.bytes_read) == (3, 3 * SIZE, 3, 3, 1, 3 * N)
    assert s.healthy and s.corrupt_blocks == s.dropped_writes == s.evictions == 0
    assert tier.take_events() == [TierEvent(EventKind.STORED, key(i)) for i in range(3)]
    assert tier.take_events() == []


def test_a_stored_block_is_not_rewritten(tier):
    put(tier, 0)
    put(tier, 0)
    assert tier.stats().writes == 1 and tier.contains(key(0))


def test_read_into_writes_exact_bytes_and_nothing_else(tier):
    put(tier, 0)
    buf = bytearray(b"\xee" * (N + 8))
    assert tier.read_into(key(0), memoryview(buf))
    assert bytes(buf[:N]) == payload(0) and buf[N:] == b"\xee" * 8
    untouched = bytearray(N)
    assert not tier.read_into(key(5), memoryview(untouched)) and untouched == bytearray(N)
    with pytest.raises(ValueError, match="cannot hold"):
        tier.read_into(key(0), memoryview(bytearray(N - 1)))


def test_reopen_finds_chains_per_namespace(tmp_path):
    with DiskTier(tmp_path, budget_bytes=1 << 20) as tier:
        put(tier, 0, 1, 2)
        put(tier, 3, ns=OTHER)
    with DiskTier(tmp_path, budget_bytes=1 << 20) as tier:
        assert sorted(tier.scan()) == sorted([BlockMeta(key(i), parent(i), NS, N) for i in range(3)]
                                             + [BlockMeta(key(3), parent(3), OTHER, N)])
        assert tier.get(key(2)) == payload(2)
        assert tier.stats().bytes_used == 3 * SIZE + stored_bytes(OTHER, N)
        tier.check_integrity()


@pytest.mark.parametrize("where", ["payload", "header"])
def test_corrupt_block_is_a_counted_deleted_miss(tmp_path, where):
    with DiskTier(tmp_path, budget_bytes=1 << 20) as tier:
        put(tier, 0, 1, 2, n=4096)
    data = bytearray((tmp_path / "data.mdb").read_bytes())
    at = data.find(payload(1, 4096)) + (2000 if where == "payload" else -SIZE + N)  # mid-payload, or the magic
    data[at] ^= 0xFF
    (tmp_path / "data.mdb").write_bytes(data)
    with DiskTier(tmp_path, budget_bytes=1 << 20) as tier:
        assert tier.get(key(1)) is None
        assert tier.get(key(1)) is None  # counted once
        assert [tier.get(key(i)) for i in (0, 2)] == [payload(0, 4096), payload(2, 4096)]
        assert tier.stats().corrupt_blocks == 1
        assert tier.flush(timeout=10)
        assert stored(tier) == {0, 2} and not tier.contains(key(1))
        tier.check_integrity()
        put(tier, 1, n=4096)  # recomputed and stored again
        assert tier.get(key(1)) == payload(1, 4096)


def test_lru_evicts_exactly_the_least_recently_used(tmp_path):
    with DiskTier(tmp_path, budget_bytes=4 * SIZE) as tier:
        put(tier, 0, 1, 2, 3)
        assert tier.get(key(0)) == payload(0)  # order now 1, 2, 3, 0
        tier.take_events()
        put(tier, 4)
        assert tier.take_events() == [TierEvent(EventKind.REMOVED, key(1)), TierEvent(EventKind.STORED, key(4))]
        assert tier.read_into(key(2), memoryview(bytearray(N)))  # order now 3, 0, 4, 2
        put(tier, 5, 6)
        assert stored(tier) == {2, 4, 5, 6} and tier.get(key(1)) is None
        s = tier.stats()
        assert (s.evictions, s.bytes_used, s.blocks) == (3, 4 * SIZE, 4)
        tier.check_integrity()


def test_a_block_larger_than_the_budget_is_dropped(tmp_path):
    with DiskTier(tmp_path, budget_bytes=SIZE) as tier:
        put(tier, 0, n=N + 1)
        assert tier.stats().dropped_writes == 1 and stored(tier) == set()
        assert tier.take_events() == [TierEvent(EventKind.REMOVED, key(0))]  # the daemon forgets it


def test_a_full_map_never_raises(tmp_path):
    n = 64 << 10
    with DiskTier(tmp_path, budget_bytes=100 << 20, map_size=1 << 20, max_batch_blocks=4) as tier:
        for i in range(40):
            tier.put_async(NS, key(i), parent(i), payload(i, n))
        assert tier.flush(timeout=30)
        s = tier.stats()
        assert s.healthy and s.evictions > 0 and s.writes + s.dropped_writes == 40
        assert all(tier.get(key(i)) == payload(i, n) for i in stored(tier))
        tier.check_integrity()


def test_delete_namespace(tier):
    put(tier, 0, 1, 2)
    put(tier, 3, 4, ns=OTHER)
    tier.take_events()
    assert tier.delete_namespace(NS) == 3
    assert stored(tier) == {3, 4} and tier.get(key(0)) is None
    assert {e for e in tier.take_events()} == {TierEvent(EventKind.REMOVED, key(i)) for i in range(3)}
    assert tier.delete_namespace("unknown") == 0
    assert tier.stats().bytes_used == 2 * stored_bytes(OTHER, N)


def test_unwritable_path_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(DiskTierError, match=f"{tmp_path}/file/l3"):
        DiskTier(tmp_path / "file" / "l3", budget_bytes=1 << 20)
    with pytest.raises(ValueError):
        DiskTier(tmp_path / "ok", budget_bytes=0)


def modes(directory: Path) -> tuple[int, int, int]:
    return tuple(os.stat(p).st_mode & 0o777 for p in (directory, directory / "data.mdb", directory / "lock.mdb"))


def test_the_environment_is_private(tmp_path):
    with DiskTier(tmp_path / "new", budget_bytes=1 << 20):
        assert modes(tmp_path / "new") == (0o700, 0o600, 0o600)
    lmdb.open(str(tmp_path / "old"), mode=0o644).close()  # as made before: a 0755 directory, 0644 files
    os.chmod(tmp_path / "old", 0o755)
    with DiskTier(tmp_path / "old", budget_bytes=1 << 20):
        assert modes(tmp_path / "old") == (0o700, 0o644, 0o644)


def test_full_queue_drops_and_counts(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, budget_bytes=1 << 20, max_queue_bytes=2 * N)
    entered, release, write = threading.Event(), threading.Event(), tier._write

    def gated(puts):
        entered.set()
        release.wait(10)
        write(puts)

    monkeypatch.setattr(tier, "_write", gated)
    assert tier.put_async(NS, key(0), parent(0), payload(0))
    assert entered.wait(10)  # the writer holds block 0 and stalls; the queue is empty again
    assert [tier.put_async(NS, key(i), parent(i), payload(i)) for i in (1, 2, 3)] == [True, True, False]
    release.set()
    assert tier.flush(timeout=10) and stored(tier) == {0, 1, 2}
    assert tier.stats().dropped_writes == 1
    tier.close()
    assert not tier.put_async(NS, key(4), parent(4), payload(4)) and tier.stats().dropped_writes == 2
    assert tier.get(key(0)) is None


def gate_writer(tier: DiskTier, monkeypatch) -> tuple[list, threading.Event, threading.Event]:
    """Holds the writer in each batch of puts until `release` is set (`entered` is set when it first waits there);
    `policies` gets its scheduling policy in each batch: SCHED_IDLE, or SCHED_OTHER with its nice value."""
    policies, entered, release, write = [], threading.Event(), threading.Event(), tier._write

    def gated(puts):
        if puts:  # not the flush's barrier
            policy = os.sched_getscheduler(0)
            policies.append(policy if policy == os.SCHED_IDLE else (policy, os.getpriority(os.PRIO_PROCESS, 0)))
        entered.set()
        release.wait(10)
        write(puts)

    monkeypatch.setattr(tier, "_write", gated)
    return policies, entered, release


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not can_leave_idle(), reason="no SCHED_IDLE, or no way back here")
def test_the_writer_runs_on_idle_cores_until_its_backlog_grows(tmp_path, monkeypatch):
    """Idle cores only (SCHED_IDLE) while three quarters of the queue's bound or less waits; past it, normal
    scheduling at the daemon's nice until the backlog halves."""
    tier = DiskTier(tmp_path, budget_bytes=1 << 20, max_queue_bytes=7 * N, max_batch_blocks=1)  # urgent past 5.25 N
    policies, entered, release = gate_writer(tier, monkeypatch)
    assert tier.put_async(NS, key(0), parent(0), payload(0))
    assert entered.wait(10)  # block 0 taken with a backlog of N
    writer = tier._writer.native_id
    assert all(tier.put_async(NS, key(i), parent(i), payload(i)) for i in range(1, 6))
    assert os.sched_getscheduler(writer) == os.SCHED_IDLE  # a backlog of 5 N
    assert tier.put_async(NS, key(6), parent(6), payload(6))
    assert os.sched_getscheduler(writer) == os.SCHED_OTHER  # 6 N: moved by the put, inside the writer's batch
    release.set()  # blocks 1 to 6 are taken with backlogs of 6 N, 5 N, ... N
    assert tier.flush(timeout=10) and stored(tier) == set(range(7))
    assert policies == [os.SCHED_IDLE] + [(os.SCHED_OTHER, tier._nice)] * 4 + [os.SCHED_IDLE] * 2
    tier.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not can_leave_idle(), reason="no SCHED_IDLE, or no way back here")
def test_an_urged_writer_leaves_idle_cores_until_the_urge_lapses(tmp_path, monkeypatch):
    """A small backlog stays on idle cores; after `urge` the writer runs at normal scheduling, at the daemon's nice,
    for `URGE_S`."""
    monkeypatch.setattr(lmdb_tier, "URGE_S", 2.0)  # room for blocks 1 and 2 to be taken, however loaded the host
    tier = DiskTier(tmp_path, budget_bytes=1 << 20, max_queue_bytes=100 * N, max_batch_blocks=1)
    policies, entered, release = gate_writer(tier, monkeypatch)
    assert tier.put_async(NS, key(0), parent(0), payload(0))
    assert entered.wait(10)  # block 0 taken idle, with a backlog far under the bound
    assert all(tier.put_async(NS, key(i), parent(i), payload(i)) for i in (1, 2))
    tier.urge()
    release.set()  # blocks 1 and 2 are taken while urged
    assert tier.flush(timeout=10)
    time.sleep(2.1)  # the urge lapses
    put(tier, 3)
    assert policies == [os.SCHED_IDLE, (os.SCHED_OTHER, tier._nice), (os.SCHED_OTHER, tier._nice), os.SCHED_IDLE]
    tier.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not can_leave_idle(), reason="no SCHED_IDLE, or no way back here")
def test_an_urge_moves_a_writer_off_idle_cores_in_the_middle_of_a_write(tmp_path, monkeypatch):
    """Beside busy cores a SCHED_IDLE writer may not return from a commit for a second: `urge` changes its policy
    from the urging thread, while the writer is still inside its batch."""
    tier = DiskTier(tmp_path, budget_bytes=1 << 20, max_queue_bytes=100 * N, max_batch_blocks=1)
    policies, entered, release = gate_writer(tier, monkeypatch)
    assert tier.put_async(NS, key(0), parent(0), payload(0))
    assert entered.wait(10)
    writer = tier._writer.native_id
    assert os.sched_getscheduler(writer) == os.SCHED_IDLE
    tier.urge()
    assert (os.sched_getscheduler(writer), os.getpriority(os.PRIO_PROCESS, writer)) == (os.SCHED_OTHER, tier._nice)
    release.set()
    assert tier.flush(timeout=10) and stored(tier) == {0}
    assert policies == [os.SCHED_IDLE]  # its batch began idle
    tier.close()


def test_puts_wait_for_a_quiet_spell_unless_flushed_or_urged(tmp_path, monkeypatch):
    monkeypatch.setattr(lmdb_tier, "QUIET_S", 1.0)
    with DiskTier(tmp_path, budget_bytes=1 << 20) as tier:
        quiet_from = time.monotonic() + 1.0  # taken first: the quiet spell ends at quiet_from or later
        tier.note_request()
        assert tier.put_async(NS, key(0), parent(0), payload(0))
        time.sleep(0.2)
        assert stored(tier) == set()  # held back: a request used the cache 0.2 s ago
        assert wait_for(lambda: stored(tier) == {0}) and time.monotonic() >= quiet_from  # once none had for QUIET_S
        monkeypatch.setattr(lmdb_tier, "QUIET_S", 600.0)  # from here on only a flush or an urge can write
        tier.note_request()
        put(tier, 1)  # a flush does not wait for quiet (put's flush has 10 s)
        assert stored(tier) == {0, 1}
        tier.note_request()
        assert tier.put_async(NS, key(2), parent(2), payload(2))
        tier.urge()
        assert wait_for(lambda: stored(tier) == {0, 1, 2})  # urged: written without the quiet spell


def test_a_flush_writes_every_block_queued_before_it_without_waiting_for_quiet(tmp_path, monkeypatch):
    monkeypatch.setattr(lmdb_tier, "QUIET_S", 600.0)  # only a flush can write here
    with DiskTier(tmp_path, budget_bytes=1 << 20, max_batch_blocks=1) as tier:
        tier.note_request()
        for i in range(3):  # three batches of one put: none may wait for quiet while the flush is pending
            assert tier.put_async(NS, key(i), parent(i), payload(i))
        assert tier.flush(timeout=10) and stored(tier) == {0, 1, 2}
        tier.note_request()
        assert tier.put_async(NS, key(3), parent(3), payload(3))
        time.sleep(0.2)
        assert stored(tier) == {0, 1, 2}  # the flush is done: a later put waits for quiet again


class _BrokenEnv:
    def begin(self, **kw):
        raise lmdb.DiskError("injected")

    def sync(self, force):
        raise lmdb.DiskError("injected")


def test_io_errors_mark_unhealthy_and_never_raise(tier, monkeypatch):
    put(tier, 0)
    monkeypatch.setattr(tier, "_env", _BrokenEnv())
    assert tier.get(key(0)) is None and not tier.healthy
    assert tier.put_async(NS, key(1), parent(1), payload(1)) and tier.flush(timeout=10)
    s = tier.stats()
    assert not s.healthy and s.io_errors >= 2 and s.dropped_writes == 1
    assert TierEvent(EventKind.REMOVED, key(1)) in tier.take_events()
    monkeypatch.undo()


def test_read_delay(tmp_path):
    with DiskTier(tmp_path, budget_bytes=1 << 20, read_delay_s=0.05) as tier:
        put(tier, 0)
        start = time.monotonic()
        assert tier.get(key(0)) == payload(0)
        assert time.monotonic() - start >= 0.05


WRITER = """
import sys
from kvcached.tiers.lmdb_tier import DiskTier
from tests.kvcache_helpers import NS, key, parent, payload
tier = DiskTier(sys.argv[1], budget_bytes=1 << 30, max_batch_blocks=8)
for i in range(200_000):
    tier.put_async(NS, key(i), parent(i), payload(i, 8192))
    if i == 20:
        tier.flush()
        print("ready", flush=True)
"""


def test_kill_9_mid_stream_leaves_a_clean_env(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).parent.parent)
    assert child.stdout.readline() == "ready\n"
    time.sleep(0.5)
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    with DiskTier(tmp_path, budget_bytes=1 << 30) as tier:
        metas = list(tier.scan())
        ids = {int.from_bytes(m.hash, "big") - 1 for m in metas}
        assert set(range(21)) <= ids
        assert all(m.parent_hash == parent(i) for m, i in zip(metas, sorted(ids)))
        assert all(tier.get(key(i)) == payload(i, 8192) for i in ids)
        assert tier.stats().corrupt_blocks == 0
        tier.check_integrity()
