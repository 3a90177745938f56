"""Cache-aware, load-aware worker choice (pure: no channels are opened)."""

from __future__ import annotations

import pytest

from radixserve.blocks.keys import BlockHash
from radixserve.v1 import router_pb2, worker_pb2
from router.routing import NoWorker, PrefixMemory, WorkerHandle, WorkerPool

A, B, C, D = (BlockHash(bytes([i]) * 16) for i in range(4))


def handle(name: str, memory_pages: int = 8) -> WorkerHandle:
    info = worker_pb2.WorkerInfo(model=router_pb2.ModelInfo(fingerprint="f"))
    return WorkerHandle(name, stub=None, info=info, memory=PrefixMemory(memory_pages))


@pytest.mark.parametrize("held,query,matched", [([], [A, B], 0), ([A, B], [A, B, C], 2), ([B], [A, B], 0),
                                                ([A, C], [A, B, C], 1)])
def test_prefix_memory_matches_the_leading_run(held, query, matched):
    memory = PrefixMemory(8)
    memory.remember(held)
    assert memory.matched(query) == matched


def test_prefix_memory_forgets_least_recently_used_keys():
    memory = PrefixMemory(3)
    memory.remember([A, B, C])
    memory.remember([A])  # A is now the most recent
    memory.remember([D])
    assert (memory.matched([A]), memory.matched([B]), memory.matched([C, D])) == (1, 0, 2)


def test_the_worker_holding_the_prefix_wins_within_the_load_slack():
    first, second = handle("w1"), handle("w2")
    pool = WorkerPool([first, second], load_slack=1)
    with pool.pick([D]) as chosen:
        assert chosen is first and first.in_flight == 1  # nothing remembered: least loaded, then earliest listed
    assert first.in_flight == 0 and first.memory.matched([D]) == 1
    second.memory.remember([A, B])
    first.in_flight, second.in_flight = 0, 1
    assert pool.choose([A, B, C]) is second
    second.in_flight = 2  # beyond the slack: load wins over the cache
    assert pool.choose([A, B, C]) is first


def test_without_keys_the_least_loaded_worker_wins():
    first, second = handle("w1"), handle("w2")
    first.in_flight = 1
    assert WorkerPool([first, second], load_slack=2).choose([]) is second


def test_unhealthy_and_excluded_workers_get_no_traffic():
    first, second = handle("w1"), handle("w2")
    pool = WorkerPool([first, second], load_slack=2)
    first.memory.remember([A, B])
    pool.mark_failed(first)
    assert pool.choose([A, B]) is second and pool.serving
    assert pool.choose([A, B], exclude=[first]) is second
    with pytest.raises(NoWorker, match="no healthy model worker"):
        pool.choose([A], exclude=[second])
    second.healthy = False
    assert not pool.serving


def test_a_worker_with_a_new_fingerprint_forgets_what_it_held():
    worker = handle("w1")
    pool = WorkerPool([worker], load_slack=2)
    worker.memory.remember([A])
    pool.update(worker, worker_pb2.WorkerInfo(model=router_pb2.ModelInfo(fingerprint="f"), kv_pages_total=8))
    assert worker.memory.matched([A]) == 1  # same fingerprint: kept
    pool.update(worker, worker_pb2.WorkerInfo(model=router_pb2.ModelInfo(fingerprint="g"), kv_pages_total=8))
    assert worker.memory.matched([A]) == 0 and worker.info.model.fingerprint == "g"
    assert pool.routing_fingerprint == "f"  # routing keys keep their namespace
