"""The disk tier's filesystem fills while kvcached writes to it, through real processes: the tier turns unhealthy
(its health name NOT_SERVING), every request still gets the cache-off greedy tokens, nothing crashes, a restarted
kvcached reopens what was committed before the fill and serves it, and no shared-memory segment is left behind.

    router ─────► worker (float32, a 20-page L1) ──► kvcached (write_through to L3)
    router_off ─► worker (--disable-radix-cache: the references)

How the disk fills: the test lowers the running daemon's RLIMIT_FSIZE (prlimit(2) on its pid) to the size its LMDB
data file has then, so the next write that grows the file fails: EFBIG, where a full filesystem gives ENOSPC; LMDB
sees both as a failed write of its pages at commit, and the writer takes the same path. Python ignores SIGXFSZ, so
the write fails instead of killing the daemon. Why not a small tmpfs: mounting one needs root or an unprivileged
user namespace (CI runners often forbid both), and kvcached would have to start inside that mount namespace;
prlimit works for any process of the same user.
"""

from __future__ import annotations

import os
import resource

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvcached.__main__ import DISK_HEALTH
from radixserve.launch import LocalServices, wait_for
from radixserve.v1 import router_pb2
from tests.stack import GREEDY, PAGE, ask, cached_blocks, document, kvcached_stats, router_stub, segments_of

pytestmark = pytest.mark.e2e

FLOAT32 = ["--dtype", "float32"]  # batched decode equals decode alone in float32 (test_engine_real.py)
SENTENCES = 20  # ~250-token prompts: 15 pages, 11 MB of float32 KV each
L1_PAGES = 20  # a request needs 15: the worker's own cache has forgotten a prompt two prompts later


def prompt(seed: int):
    return ask(document(seed, SENTENCES), "What is this about?")


def answer(router: str, seed: int) -> router_pb2.GenerateResponse:
    request = router_pb2.GenerateRequest(messages=prompt(seed), sampling=GREEDY)
    (response,) = router_stub(router).Generate(request, timeout=120)
    return response


def disk_serving(kvcached: str) -> bool:
    with grpc.insecure_channel(kvcached) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=DISK_HEALTH),
                                                           timeout=5).status
    return status == health_pb2.HealthCheckResponse.SERVING


def fill_disk(pid: int, data_file: str) -> None:
    """From now on process `pid` cannot grow any file past `data_file`'s present size."""
    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (os.path.getsize(data_file), hard))


def test_a_full_disk_turns_the_tier_unhealthy_and_costs_no_request(tmp_path):
    services = LocalServices(tmp_path)
    pids: set[int] = set()
    try:
        kvcached = services.kvcached()
        worker = services.worker(kvcached, args=[*FLOAT32, "--num-pages", str(L1_PAGES)])
        router = services.router([worker], kvcached, args=["--prefetch-policy", "wait_complete"])
        router_off = services.router([worker], kvcached, "router_off", ["--disable-radix-cache"])
        pids |= {services.processes[name].pid for name in ("kvcached", "worker")}
        seeds = range(500, 506)
        references = {seed: list(answer(router_off, seed).token_ids) for seed in seeds}

        # Healthy: write-through puts every committed block on disk, the computed full pages (the last token is
        # never fed back).
        first = answer(router, 500)
        assert list(first.token_ids) == references[500]
        before_fill = (first.usage.prompt_tokens + first.usage.completion_tokens - 1) // PAGE
        assert wait_for(lambda: cached_blocks(kvcached) == kvcached_stats(kvcached).disk.blocks == before_fill)
        fill_disk(services.processes["kvcached"].pid, str(tmp_path / "kvcached-l3" / "data.mdb"))

        # The disk is full: the next blocks cannot land, the tier turns unhealthy, every answer is still right.
        assert [list(answer(router, seed).token_ids) for seed in seeds[1:4]] == [references[s] for s in seeds[1:4]]
        assert wait_for(lambda: not disk_serving(kvcached), 10), "the disk tier's health never left SERVING"
        stats = kvcached_stats(kvcached)
        assert not stats.disk.healthy and stats.disk.blocks == before_fill
        again = answer(router, 501)  # still in L2: shared memory keeps serving
        assert list(again.token_ids) == references[501] and again.usage.cached_tokens_l2 > 0
        assert list(answer(router, 504).token_ids) == references[504]
        assert all(p.poll() is None for p in services.processes.values()), "a service died"

        # A restarted daemon reopens the environment the failed writes left: what was committed is served from it.
        assert services.stop_service("kvcached") == 0
        services.start_again("kvcached")  # a new process: no file-size limit
        pids.add(services.processes["kvcached"].pid)
        assert services.workers_registered([worker])
        stats = kvcached_stats(kvcached)
        assert stats.disk.healthy and stats.disk.blocks == before_fill and stats.disk.corrupt_blocks == 0
        assert disk_serving(kvcached)
        restored = answer(router, 500)  # long gone from the worker's L1 and from the new daemon's L2
        assert list(restored.token_ids) == references[500] and restored.usage.cached_tokens_l3 > 0
        assert list(answer(router, 505).token_ids) == references[505]
    finally:
        services.stop()
    assert segments_of(pids) == set()
