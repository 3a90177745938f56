"""The disk tier's faults and operator command through a real kvcached process."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvcached.__main__ import DISK_HEALTH
from radixserve.launch import REPO, Stack, free_port
from radixserve.v1 import kvcache_pb2 as pb
from radixserve.v1 import kvcache_pb2_grpc
from tests.kvcache_helpers import DAEMON_GEO, PAGE, toks

FP = "ab" * 32


def daemon_args(disk_path, *extra: str) -> list[str]:
    return ["--metrics-port", "0", "--host-cache-size-gb", "0.01", "--page-size", str(PAGE),
            "--disk-cache-path", str(disk_path), "--disk-cache-size-gb", "0.05", "--drain-grace-s", "1", *extra]


@pytest.fixture
def stack():
    with Stack() as running:
        yield running


def start(stack: Stack, tmp_path, disk_path, *extra: str) -> kvcache_pb2_grpc.KVCacheStub:
    port = free_port()
    with open(tmp_path / f"kvcached-{port}.log", "ab") as log:
        stack.start("kvcached", port, daemon_args(disk_path, *extra), timeout_s=60, stdout=log,
                    stderr=subprocess.STDOUT, cwd=REPO)
    return kvcache_pb2_grpc.KVCacheStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


def test_unwritable_disk_path_is_a_clear_start_up_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    run = subprocess.run([sys.executable, "-m", "kvcached", "--port", str(free_port()),
                          *daemon_args(blocker / "l3")], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert run.returncode != 0
    assert "cannot open the disk tier" in run.stderr and str(blocker) in run.stderr


def test_optional_disk_tier_runs_without_it(stack, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    kv = start(stack, tmp_path, blocker / "l3", "--disk-cache-optional")
    assert kv.GetStats(pb.GetStatsRequest()).disk.enabled is False


def write_blocks(kv: kvcache_pb2_grpc.KVCacheStub, pages: int) -> None:
    handle = kv.RegisterNamespace(pb.RegisterNamespaceRequest(model_fingerprint=FP, geometry=DAEMON_GEO.to_pb()))
    allocation = kv.AllocateSlots(pb.AllocateSlotsRequest(model_fingerprint=FP, count=pages,
                                                          segment_name=handle.segment_name))
    kv.CommitBlocks(pb.CommitBlocksRequest(model_fingerprint=FP, token_ids=toks(*range(1, pages + 1)),
                                           slots=allocation.slots, allocation_id=allocation.allocation_id))


def wait_disk_blocks(kv: kvcache_pb2_grpc.KVCacheStub, n: int, timeout_s: float = 10) -> int:
    deadline = time.monotonic() + timeout_s
    while (blocks := kv.GetStats(pb.GetStatsRequest()).disk.blocks) < n and time.monotonic() < deadline:
        time.sleep(0.1)
    return blocks


def test_drop_namespace_removes_only_an_unregistered_models_blocks(stack, tmp_path):
    disk = tmp_path / "l3"
    kv = start(stack, tmp_path, disk)
    write_blocks(kv, 3)
    assert wait_disk_blocks(kv, 3) == 3
    with pytest.raises(grpc.RpcError) as err:
        kv.DropNamespace(pb.DropNamespaceRequest(model_fingerprint=FP))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "registered" in err.value.details()
    stack.stop()  # flushes; the restarted daemon has the blocks on disk but FP is not registered there
    kv = start(stack, tmp_path, disk)
    assert kv.GetStats(pb.GetStatsRequest()).disk.blocks == 3
    assert kv.DropNamespace(pb.DropNamespaceRequest(model_fingerprint=FP)).dropped_blocks == 3
    assert kv.GetStats(pb.GetStatsRequest()).disk.blocks == 0


def test_disk_tier_has_its_own_health_status(stack, tmp_path):
    port = free_port()
    with open(tmp_path / "kvcached.log", "ab") as log:
        stack.start("kvcached", port, daemon_args(tmp_path / "l3"), timeout_s=60, stdout=log,
                    stderr=subprocess.STDOUT, cwd=REPO)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    request = health_pb2.HealthCheckRequest(service=DISK_HEALTH)
    deadline = time.monotonic() + 5
    while True:  # the component's first status lands within a poll
        try:
            assert health.Check(request).status == health_pb2.HealthCheckResponse.SERVING
            return
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.NOT_FOUND and time.monotonic() < deadline
            time.sleep(0.1)


def cold_prefetch(stack: Stack, tmp_path, disk, args: list[str], pages: int) -> tuple[kvcache_pb2_grpc.KVCacheStub,
                                                                                         str]:
    """A daemon started afresh on `disk` (L2 empty, L3 holding `pages` pages) and the id of a prefetch of them."""
    stack.stop()
    kv = start(stack, tmp_path, disk, *args)
    kv.RegisterNamespace(pb.RegisterNamespaceRequest(model_fingerprint=FP, geometry=DAEMON_GEO.to_pb()))
    match = kv.MatchPrefix(pb.MatchPrefixRequest(model_fingerprint=FP, token_ids=toks(*range(1, pages + 1)),
                                                 prefetch=True))
    assert match.matched_pages == 0 and match.l3_pages == pages and match.prefetch_id
    return kv, match.prefetch_id


def test_a_cost_aware_wait_outlasts_its_timeout_while_the_rest_loads_sooner_than_it_recomputes(stack, tmp_path):
    """Pages that load in 5 ms each and would recompute in 40 ms: past a 60 ms timeout a plain wait returns with
    the load half done, a cost-aware one waits for the rest."""
    disk, pages = tmp_path / "l3", 48
    args = ["--l3-read-delay-ms", "5", "--recompute-tokens-per-s", "100"]
    write_blocks(start(stack, tmp_path, disk, *args), pages)
    kv, prefetch_id = cold_prefetch(stack, tmp_path, disk, args, pages)
    plain = kv.WaitPrefetch(pb.WaitPrefetchRequest(prefetch_id=prefetch_id, timeout_ms=60))
    assert not plain.done and plain.ready_pages < pages
    kv, prefetch_id = cold_prefetch(stack, tmp_path, disk, args, pages)
    patient = kv.WaitPrefetch(pb.WaitPrefetchRequest(prefetch_id=prefetch_id, timeout_ms=60, cost_aware=True))
    assert patient.done and patient.ready_pages == patient.total_pages == pages


def test_a_cost_aware_wait_stops_at_its_timeout_when_recomputing_is_cheaper(stack, tmp_path):
    """Pages that load in 5 ms each and recompute in 2 ms (a prefetch starts on its first guess of the disk's
    speed; its first reads show it is slower than recomputing): the wait ends at its timeout."""
    disk, pages = tmp_path / "l3", 48
    args = ["--l3-read-delay-ms", "5", "--recompute-tokens-per-s", "2000"]
    write_blocks(start(stack, tmp_path, disk, *args), pages)
    kv, prefetch_id = cold_prefetch(stack, tmp_path, disk, args, pages)
    waited = kv.WaitPrefetch(pb.WaitPrefetchRequest(prefetch_id=prefetch_id, timeout_ms=60, cost_aware=True))
    assert not waited.done and waited.ready_pages < pages
