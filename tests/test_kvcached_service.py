"""The kvcached daemon through real processes: `python -m kvcached` on free ports, driven over gRPC, grpcurl and
its Prometheus endpoint, with a client that attaches to its shared-memory pool the way a worker does.

Page size 4 and 16 KiB blocks. Each test works in its own namespace (model fingerprint), so tests sharing a daemon
see each other only in the cumulative metrics, which they read as deltas.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from model_worker.block_copy import HostBlockCopy
from model_worker.kvcache_client import KVCacheClient
from radixserve.blocks.slab import SHM_DIR, SlabSegment
from radixserve.launch import REPO, Stack, free_port, wait_for
from radixserve.transport import TransportSecurity
from radixserve.v1 import common_pb2
from radixserve.v1 import kvcache_pb2 as pb
from radixserve.v1 import kvcache_pb2_grpc
from tests.kvcache_helpers import DAEMON_GEO, PAGE, toks
from tests.stack import GRPCURL, segments_of

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs Linux /dev/shm")

GEO = DAEMON_GEO.to_pb()
SLOT_BYTES = 4 * 2 * PAGE * 2 * 64 * 4  # layers * (K, V) * page * heads * head_dim * float32 = 16 KiB
POOL_GB = 0.01
NUM_SLOTS = int(POOL_GB * (1 << 30)) // SLOT_BYTES  # 655
SMALL_POOL_GB = 4.5 * SLOT_BYTES / (1 << 30)  # 4 slots
SHORT_TTL_S = 1.0  # short, yet long enough for a few RPCs on a loaded machine before anything expires


@dataclass
class Daemon:
    process: subprocess.Popen
    port: int
    metrics_port: int
    log: Path
    channel: grpc.Channel

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def stub(self) -> kvcache_pb2_grpc.KVCacheStub:
        return kvcache_pb2_grpc.KVCacheStub(self.channel)

    def segments(self) -> set[str]:
        return segments_of({self.process.pid})

    def serving(self) -> bool:
        check = health_pb2_grpc.HealthStub(self.channel).Check
        return check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING

    def metrics(self) -> dict[tuple, float]:
        """Every sample of the Prometheus endpoint, keyed by (name, sorted label items)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            text = response.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def namespace_stats(self, fingerprint: str) -> pb.NamespaceStats:
        found = [ns for ns in self.stub.GetStats(pb.GetStatsRequest(), timeout=5).namespaces
                 if ns.model_fingerprint == fingerprint]
        assert len(found) == 1, f"GetStats lists {fingerprint!r} {len(found)} times"
        return found[0]


class Daemons:
    """Starts daemons on free ports; `close()` stops what still runs and removes whatever segments they left."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[Daemon] = []

    def start(self, *args: str, lease_ttl_s: float = 30.0, pool_gb: float = POOL_GB) -> Daemon:
        port, metrics_port = free_port(), free_port()
        log = self.log_dir / f"kvcached-{port}.log"
        stack = Stack()
        # process_group=0: the daemon and its multiprocessing resource tracker form one group (see test_kill_9).
        with open(log, "ab") as out:
            try:
                process = stack.start("kvcached", port, [
                    "--metrics-port", str(metrics_port), "--host-cache-size-gb", str(pool_gb),
                    "--page-size", str(PAGE), "--lease-ttl-s", str(lease_ttl_s), "--drain-grace-s", "1",
                    "--disk-cache-size-gb", "0", *args],  # L2 only here: test_l3_e2e.py covers the disk tier
                    timeout_s=60, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, process_group=0)
            except BaseException:
                stack.stop(timeout_s=5)
                raise
        daemon = Daemon(process, port, metrics_port, log, grpc.insecure_channel(f"127.0.0.1:{port}"))
        self.started.append(daemon)
        return daemon

    def close(self) -> None:
        for daemon in self.started:
            daemon.channel.close()
            if daemon.process.poll() is None:
                daemon.process.send_signal(signal.SIGTERM)
                try:
                    daemon.process.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(daemon.process.pid, signal.SIGKILL)
                    daemon.process.wait()
            for name in segments_of({daemon.process.pid}):  # a test failed before it could check this
                os.unlink(os.path.join(SHM_DIR, name))


@pytest.fixture(scope="module")
def module_daemons(tmp_path_factory):
    daemons = Daemons(tmp_path_factory.mktemp("kvcached-logs"))
    yield daemons
    daemons.close()


@pytest.fixture
def daemons(tmp_path):
    daemons = Daemons(tmp_path)
    yield daemons
    daemons.close()


@pytest.fixture(scope="module")
def daemon(module_daemons) -> Daemon:
    """Shared by most tests: a 655-slot pool per namespace, leases and allocations live 30 s."""
    return module_daemons.start()


@pytest.fixture(scope="module")
def short_lived(module_daemons) -> Daemon:
    """Leases and allocations expire after SHORT_TTL_S."""
    return module_daemons.start(lease_ttl_s=SHORT_TTL_S)


@pytest.fixture(scope="module")
def small(module_daemons) -> Daemon:
    """A pool holds 4 blocks."""
    return module_daemons.start(pool_gb=SMALL_POOL_GB)


@pytest.fixture
def fp(request) -> str:
    return f"fp-{request.node.name}"


def register(daemon: Daemon, fingerprint: str, **geometry) -> pb.PoolHandle:
    geo = common_pb2.BlockGeometry()
    geo.CopyFrom(GEO)
    for key, value in geometry.items():
        setattr(geo, key, value)
    return daemon.stub.RegisterNamespace(pb.RegisterNamespaceRequest(model_fingerprint=fingerprint, geometry=geo),
                                         timeout=5)


def allocate(stub, fingerprint: str, count: int) -> pb.AllocateSlotsResponse:
    """AllocateSlots in the namespace's segment, as a registered worker asks."""
    segment = stub.RegisterNamespace(pb.RegisterNamespaceRequest(model_fingerprint=fingerprint, geometry=GEO),
                                     timeout=5).segment_name
    return stub.AllocateSlots(pb.AllocateSlotsRequest(model_fingerprint=fingerprint, count=count,
                                                      segment_name=segment), timeout=5)


def put(daemon: Daemon, fingerprint: str, token_ids: list[int], first_page: int = 0) -> list[int]:
    """Allocates and commits pages [first_page, full pages) of `token_ids`, writing nothing; returns the slots."""
    count = len(token_ids) // PAGE - first_page
    allocation = allocate(daemon.stub, fingerprint, count)
    assert len(allocation.slots) == count
    commit = daemon.stub.CommitBlocks(pb.CommitBlocksRequest(
        model_fingerprint=fingerprint, token_ids=token_ids, first_page=first_page, slots=allocation.slots,
        allocation_id=allocation.allocation_id))
    assert (commit.inserted, commit.already_cached) == (count, 0)
    return list(allocation.slots)


def assert_settled(daemon: Daemon, fingerprint: str, blocks_cached: int) -> None:
    """No lease or allocation is left, and free + cached slots make up the pool."""
    stats = daemon.namespace_stats(fingerprint)
    assert (stats.leases, stats.allocations, stats.blocks_cached) == (0, 0, blocks_cached)
    assert stats.slots_free + stats.blocks_cached == stats.slots_total
    assert daemon.serving()


def grpcurl(daemon: Daemon, *args: str, flags: tuple[str, ...] = ()) -> str:
    result = subprocess.run([GRPCURL, "-plaintext", *flags, daemon.address, *args],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout


# -- serving ----------------------------------------------------------------------------------------------------------
def test_grpcurl_lists_services_by_reflection_and_health_is_serving(daemon):
    assert set(grpcurl(daemon, "list").split()) >= {
        "radixserve.v1.KVCache", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    methods = grpcurl(daemon, "list", "radixserve.v1.KVCache")
    assert set(methods.split()) == {f"radixserve.v1.KVCache.{m}" for m in (
        "RegisterNamespace", "MatchPrefix", "AllocateSlots", "CommitBlocks", "ReleaseLease", "WaitPrefetch",
        "DropNamespace", "GetStats")}
    for service in ("", "radixserve.v1.KVCache"):
        out = grpcurl(daemon, "grpc.health.v1.Health/Check", flags=("-d", f'{{"service": "{service}"}}'))
        assert '"status": "SERVING"' in out


# -- the data path ----------------------------------------------------------------------------------------------------
def test_register_returns_the_pool_and_is_idempotent(daemon, fp):
    handle = register(daemon, fp)
    assert (handle.model_fingerprint, handle.slot_bytes, handle.num_slots) == (fp, SLOT_BYTES, NUM_SLOTS)
    assert handle.geometry == GEO
    assert handle.segment_name in daemon.segments()
    segments = daemon.segments()
    assert register(daemon, fp) == handle
    assert daemon.segments() == segments
    assert_settled(daemon, fp, 0)


def resident_bytes(segment_name: str) -> int:
    """This process's resident bytes of its mappings of the segment (`Rss` in /proc/self/smaps)."""
    total, ours = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                ours = line.rstrip().endswith("/" + segment_name)
            elif ours and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def test_a_worker_maps_in_its_first_segment_when_it_registers(daemon, fp):
    """The worker's kvcached client populates its mapping of the first segment it attaches, so that commits write
    at memory speed instead of faulting a page at a time (model_worker/kvcache_client.py, `_attach`)."""
    client = KVCacheClient(daemon.address, TransportSecurity(), fp, DAEMON_GEO,
                           torch.zeros(4, DAEMON_GEO.block_bytes // 4), 5.0, HostBlockCopy())
    try:
        assert wait_for(lambda: client.segment_name and resident_bytes(client.segment_name) >= NUM_SLOTS * SLOT_BYTES,
                        timeout_s=30), "the segment was not mapped in"
    finally:
        client.close()


def test_bytes_written_into_allocated_slots_read_back_after_match(daemon, fp):
    handle = register(daemon, fp)
    prompt = toks(1, 2, 3, tail=2)
    allocation = allocate(daemon.stub, fp, 3)
    assert len(allocation.slots) == 3
    blocks = [os.urandom(SLOT_BYTES) for _ in allocation.slots]
    pool = SlabSegment.attach(handle.segment_name, handle.slot_bytes, handle.num_slots)
    try:
        for slot, block in zip(allocation.slots, blocks):
            with pool.view(slot) as view:
                view[:] = block
        commit = daemon.stub.CommitBlocks(pb.CommitBlocksRequest(
            model_fingerprint=fp, token_ids=prompt, slots=allocation.slots, allocation_id=allocation.allocation_id))
        assert (commit.inserted, commit.already_cached) == (3, 0)
        match = daemon.stub.MatchPrefix(pb.MatchPrefixRequest(model_fingerprint=fp, token_ids=toks(1, 2, 3, 4),
                                                              lease=True))
        assert (match.matched_pages, list(match.l2_slots)) == (3, list(allocation.slots))
        assert match.lease_id and match.segment_name == handle.segment_name
        assert daemon.namespace_stats(fp).leases == 1
        for slot, block in zip(match.l2_slots, blocks):
            with pool.view(slot) as view:
                assert bytes(view) == block
    finally:
        pool.close()
    daemon.stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=match.lease_id))
    assert_settled(daemon, fp, 3)


def test_commit_continuing_a_prefix_and_commit_of_cached_pages(daemon, fp):
    register(daemon, fp)
    head = put(daemon, fp, toks(1, 2))
    tail = put(daemon, fp, toks(1, 2, 3), first_page=2)
    late = allocate(daemon.stub, fp, 3)
    commit = daemon.stub.CommitBlocks(pb.CommitBlocksRequest(
        model_fingerprint=fp, token_ids=toks(1, 2, 3), slots=late.slots, allocation_id=late.allocation_id))
    assert (commit.inserted, commit.already_cached) == (0, 3)
    match = daemon.stub.MatchPrefix(pb.MatchPrefixRequest(model_fingerprint=fp, token_ids=toks(1, 2, 3)))
    assert (match.matched_pages, list(match.l2_slots), match.lease_id) == (3, head + tail, "")
    assert_settled(daemon, fp, 3)


# -- bad input ------------------------------------------------------------------------------------------------------
@dataclass
class Setup:
    """What each bad call may refer to: a live allocation and lease, and ones already used up."""

    fp: str
    allocation: pb.AllocateSlotsResponse
    lease_id: str
    committed_allocation_id: str
    released_lease_id: str


def _commit(stub, setup, **fields):
    request = dict(model_fingerprint=setup.fp, token_ids=toks(1, 2, 3), first_page=1,
                   slots=setup.allocation.slots, allocation_id=setup.allocation.allocation_id)
    return stub.CommitBlocks(pb.CommitBlocksRequest(**{**request, **fields}))


NOT_FOUND, FAILED_PRECONDITION, INVALID_ARGUMENT = (
    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
BAD_CALLS = {
    "match unknown namespace": (NOT_FOUND, "namespace 'nope' is not registered",
                                lambda s, x: s.MatchPrefix(pb.MatchPrefixRequest(model_fingerprint="nope"))),
    "allocate unknown namespace": (NOT_FOUND, "namespace 'nope' is not registered", lambda s, x: s.AllocateSlots(
        pb.AllocateSlotsRequest(model_fingerprint="nope", count=1))),
    "allocate in a superseded segment": (FAILED_PRECONDITION, "register again", lambda s, x: s.AllocateSlots(
        pb.AllocateSlotsRequest(model_fingerprint=x.fp, count=1, segment_name="radixserve_1_00000000"))),
    "allocate past the cap": (INVALID_ARGUMENT, r"\(--max-allocation-slots\), got 4294967295",
                              lambda s, x: allocate(s, x.fp, 2**32 - 1)),
    "lease TTL past the cap": (INVALID_ARGUMENT, r"cap of 300 s \(--max-lease-ttl-s\)", lambda s, x: s.MatchPrefix(
        pb.MatchPrefixRequest(model_fingerprint=x.fp, token_ids=toks(1), lease=True, lease_ttl_ms=2**32 - 1))),
    "commit unknown namespace": (NOT_FOUND, "namespace 'nope' is not registered",
                                 lambda s, x: _commit(s, x, model_fingerprint="nope")),
    "geometry disagrees": (FAILED_PRECONDITION, "is registered with", lambda s, x: s.RegisterNamespace(
        pb.RegisterNamespaceRequest(model_fingerprint=x.fp, geometry=common_pb2.BlockGeometry(
            num_layers=4, num_kv_heads=2, head_dim=128, page_size=PAGE, dtype="float32", layout="page-first")))),
    "page size disagrees": (FAILED_PRECONDITION, "page_size 16 != kvcached --page-size 4", lambda s, x: (
        s.RegisterNamespace(pb.RegisterNamespaceRequest(model_fingerprint="other", geometry=common_pb2.BlockGeometry(
            num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="float32", layout="page-first"))))),
    "bad dtype": (INVALID_ARGUMENT, "dtype 'int8' is not one of", lambda s, x: s.RegisterNamespace(
        pb.RegisterNamespaceRequest(model_fingerprint="other", geometry=common_pb2.BlockGeometry(
            num_layers=4, num_kv_heads=2, head_dim=64, page_size=PAGE, dtype="int8", layout="page-first")))),
    "block larger than the pool": (INVALID_ARGUMENT, "larger than the whole L2 pool", lambda s, x: (
        s.RegisterNamespace(pb.RegisterNamespaceRequest(model_fingerprint="other", geometry=common_pb2.BlockGeometry(
            num_layers=1000, num_kv_heads=32, head_dim=128, page_size=PAGE, dtype="float32", layout="x"))))),
    "slots not allocated": (INVALID_ARGUMENT, r"slots \[7777\] are not this allocation's",
                            lambda s, x: _commit(s, x, slots=[x.allocation.slots[0], 7777])),
    "slot repeated": (INVALID_ARGUMENT, "or repeat",
                      lambda s, x: _commit(s, x, slots=[x.allocation.slots[0]] * 2)),
    "pages beyond token_ids": (INVALID_ARGUMENT, r"pages \[2, 4\) exceed the 3 full pages",
                               lambda s, x: _commit(s, x, first_page=2)),
    "unknown allocation": (NOT_FOUND, "allocation 'nope' is unknown", lambda s, x: _commit(s, x, allocation_id="nope")),
    "allocation committed already": (NOT_FOUND, "is unknown, expired",
                                     lambda s, x: _commit(s, x, allocation_id=x.committed_allocation_id)),
    "lease id as allocation": (NOT_FOUND, "is unknown, expired", lambda s, x: _commit(s, x, allocation_id=x.lease_id)),
    "unknown lease": (NOT_FOUND, "lease 'nope' is unknown or expired",
                      lambda s, x: s.ReleaseLease(pb.ReleaseLeaseRequest(lease_id="nope"))),
    "lease released already": (NOT_FOUND, "is unknown or expired",
                               lambda s, x: s.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=x.released_lease_id))),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_input_gets_a_precise_status_and_changes_nothing(daemon, fp, case):
    code, message, call = BAD_CALLS[case]
    register(daemon, fp)
    stub = daemon.stub
    committed = allocate(stub, fp, 1)
    stub.CommitBlocks(pb.CommitBlocksRequest(model_fingerprint=fp, token_ids=toks(1), slots=committed.slots,
                                             allocation_id=committed.allocation_id))
    released = stub.MatchPrefix(pb.MatchPrefixRequest(model_fingerprint=fp, token_ids=toks(1), lease=True))
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=released.lease_id))
    setup = Setup(fp, allocate(stub, fp, 2),
                  stub.MatchPrefix(pb.MatchPrefixRequest(model_fingerprint=fp, token_ids=toks(1), lease=True)).lease_id,
                  committed.allocation_id, released.lease_id)
    before, segments = stub.GetStats(pb.GetStatsRequest()), daemon.segments()

    with pytest.raises(grpc.RpcError) as error:
        call(stub, setup)
    assert error.value.code() == code, error.value.details()
    assert re.search(message, error.value.details()), error.value.details()

    assert stub.GetStats(pb.GetStatsRequest()) == before
    assert daemon.segments() == segments
    assert daemon.serving()
    # The live allocation and lease are intact: they still commit and release.
    commit = _commit(stub, setup)
    assert (commit.inserted, commit.already_cached) == (2, 0)
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=setup.lease_id))
    assert_settled(daemon, fp, 3)


# -- expiry, eviction, metrics --------------------------------------------------------------------------------------
def test_leases_and_allocations_expire_in_the_background(short_lived, fp):
    daemon, stub = short_lived, short_lived.stub
    register(daemon, fp)
    put(daemon, fp, toks(1))
    lease = stub.MatchPrefix(pb.MatchPrefixRequest(model_fingerprint=fp, token_ids=toks(1), lease=True)).lease_id
    kept = stub.MatchPrefix(pb.MatchPrefixRequest(model_fingerprint=fp, token_ids=toks(1), lease=True,
                                                  lease_ttl_ms=60_000)).lease_id
    allocation = allocate(stub, fp, 2)
    assert len(allocation.slots) == 2
    stats = daemon.namespace_stats(fp)
    assert (stats.leases, stats.allocations, stats.slots_free) == (2, 1, stats.slots_total - 3)
    expired_before = daemon.metrics()[("radixserve_kvcached_expired_total", ())]

    # No RPC until both have expired: the daemon's own periodic expiry must drop them, and the gauges follow.
    deadline = time.monotonic() + SHORT_TTL_S + 5
    while daemon.metrics()[("radixserve_kvcached_expired_total", ())] < expired_before + 2:
        assert time.monotonic() < deadline, "the lease and the allocation were not expired in the background"
        time.sleep(0.2)
    metrics = daemon.metrics()
    assert metrics[("radixserve_kvcached_expired_total", ())] == expired_before + 2
    assert metrics[("radixserve_kvcached_leases", ())] == 1  # `kept`

    with pytest.raises(grpc.RpcError) as error:
        stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease))
    assert error.value.code() == NOT_FOUND and "unknown or expired" in error.value.details()
    with pytest.raises(grpc.RpcError) as error:
        stub.CommitBlocks(pb.CommitBlocksRequest(model_fingerprint=fp, token_ids=toks(1, 2, 3), first_page=1,
                                                 slots=allocation.slots, allocation_id=allocation.allocation_id))
    assert error.value.code() == NOT_FOUND and "unknown, expired" in error.value.details()
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=kept))
    assert_settled(daemon, fp, 1)


def test_full_pool_evicts_lru_and_counts_it(small, fp):
    daemon, stub = small, small.stub
    assert register(daemon, fp).num_slots == 4
    first, second = put(daemon, fp, toks(1, 2)), put(daemon, fp, toks(3, 4))
    stub.MatchPrefix(pb.MatchPrefixRequest(model_fingerprint=fp, token_ids=toks(1)))  # (3, 4) is now the LRU
    evictions = daemon.metrics().get(("radixserve_kvcached_evictions_total", (("tier", "l2"),)), 0)
    allocation = allocate(stub, fp, 1)
    stub.CommitBlocks(pb.CommitBlocksRequest(model_fingerprint=fp, allocation_id=allocation.allocation_id))
    assert list(allocation.slots) == second[1:]
    assert daemon.metrics()[("radixserve_kvcached_evictions_total", (("tier", "l2"),))] == evictions + 1
    match = stub.MatchPrefix(pb.MatchPrefixRequest(model_fingerprint=fp, token_ids=toks(1, 2)))
    assert list(match.l2_slots) == first
    match = stub.MatchPrefix(pb.MatchPrefixRequest(model_fingerprint=fp, token_ids=toks(3, 4)))
    assert list(match.l2_slots) == second[:1]
    assert_settled(daemon, fp, 3)


def test_metrics_count_queries_hits_and_blocks(daemon, fp):
    register(daemon, fp)
    put(daemon, fp, toks(1, 2))
    before = daemon.metrics()
    stub = daemon.stub
    stub.MatchPrefix(pb.MatchPrefixRequest(model_fingerprint=fp, token_ids=toks(1, 2, 3, tail=2)))  # 12 asked, 8 hit
    stub.MatchPrefix(pb.MatchPrefixRequest(model_fingerprint=fp, token_ids=toks(5, tail=3)))  # 4 asked, 0 hit
    lease = stub.MatchPrefix(pb.MatchPrefixRequest(model_fingerprint=fp, token_ids=toks(1), lease=True)).lease_id
    after = daemon.metrics()

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0)

    assert delta("radixserve_kvcached_match_queries_total") == 3
    assert delta("radixserve_kvcached_query_tokens_total") == 12 + 4 + 4
    assert delta("radixserve_kvcached_hit_tokens_total", tier="l2") == 8 + 0 + 4
    assert delta("radixserve_kvcached_rpc_seconds_count", method="MatchPrefix") == 3
    assert 0 < delta("radixserve_kvcached_rpc_seconds_sum", method="MatchPrefix") < 3
    assert after[("radixserve_kvcached_leases", ())] == 1
    stats = stub.GetStats(pb.GetStatsRequest()).namespaces
    cached = sum(ns.blocks_cached for ns in stats)
    total = sum(ns.slots_total for ns in stats)
    assert after[("radixserve_kvcached_blocks", (("state", "cached"), ("tier", "l2")))] == cached
    assert after[("radixserve_kvcached_blocks", (("state", "total"), ("tier", "l2")))] == total
    assert after[("radixserve_kvcached_bytes", (("state", "cached"), ("tier", "l2")))] == cached * SLOT_BYTES
    assert after[("radixserve_kvcached_bytes", (("state", "total"), ("tier", "l2")))] == total * SLOT_BYTES
    stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease))
    assert daemon.metrics()[("radixserve_kvcached_leases", ())] == 0
    assert_settled(daemon, fp, 2)


# -- shutdown and crashes -------------------------------------------------------------------------------------------
def test_sigterm_exits_0_and_unlinks_its_pools(daemons):
    daemon = daemons.start()
    handles = [register(daemon, fp) for fp in ("a", "b")]
    assert daemon.segments() == {h.segment_name for h in handles}
    pool = SlabSegment.attach(handles[0].segment_name, SLOT_BYTES, NUM_SLOTS)  # a worker still attached
    try:
        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.process.wait(15) == 0
    finally:
        pool.close()
    assert daemon.segments() == set()
    assert '"msg": "stopped"' in daemon.log.read_text()


def test_kill_9_leaves_segments_that_the_next_daemon_removes(daemons):
    crashed = daemons.start()
    names = {register(crashed, fp).segment_name for fp in ("a", "b")}
    assert crashed.segments() == names
    # NOTE: the daemon's multiprocessing resource tracker unlinks its segments when the daemon alone dies. A crash
    # that takes the tracker too (its process group, an OOM kill of the cgroup, `docker kill`) leaves them behind.
    os.killpg(crashed.process.pid, signal.SIGKILL)
    assert crashed.process.wait(10) == -signal.SIGKILL
    assert segments_of({crashed.process.pid}) == names

    successor = daemons.start()
    assert segments_of({crashed.process.pid}) == set()
    assert all(name in successor.log.read_text() for name in names)
    assert successor.serving()
