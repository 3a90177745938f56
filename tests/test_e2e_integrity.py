"""Cached KV is never wrong, through real processes: leases that expire while their request queues, forged and stale
leases sent straight to a worker, kvcached killed under two workers, a worker restarted with another dtype, and
leases released on every path a request can end by. Every answer is compared, token for token, with the same
prompt's answer with every cache off.

    router_warm ──► worker_warm ───┐
    router_off ───► worker_warm    ├──► kvcached: 29 L2 blocks, no disk
    router_short ─► worker_queued ─┘    (router_short leases for 300 ms; worker_queued runs one request at a time)

worker_warm computes the shared prefixes and worker_queued never does, so worker_queued can only copy them out of L2,
under leases that expire while it queues; every commit evicts, so an expired lease's slots soon hold other blocks.

    router_dtype, router_dtype_off ──► worker_dtype (float32, then restarted in bfloat16) ──► kvcached
    router_plain, router_wait ───────► worker_single (one request at a time) ──► kvcached with a disk tier
"""

from __future__ import annotations

import signal
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from radixserve.launch import LocalServices, free_port, wait_for
from radixserve.v1 import kvcache_pb2, kvcache_pb2_grpc, router_pb2, worker_pb2
from tests.stack import GREEDY, PAGE, ask, document, generate, kvcached_stats, router_stub, segments_of, worker_stub

pytestmark = pytest.mark.e2e

FLOAT32 = ["--dtype", "float32"]  # batched decode equals decode alone in float32 only (test_engine_real.py), and
#                                   the L2 sizes below count float32 blocks (720 KiB)
SHORT = 12  # sentences: ~128-token prompts (8 pages); twelve decode steps cost more than their prefill
SMALL_L2_GB = "0.02"  # 29 blocks: three or four prompts
LEASE_TTL_MS = "300"  # a request queued on worker_queued waits about a second per request ahead of it
READ_DELAY_MS = 200  # per L3 block: the router's prefetch wait lasts seconds, so a cancel lands inside it
FRONT_PAGES = 8  # 128 tokens: the shortest run kvcached prefetches (--prefetch-threshold-tokens)
FORGED_SEGMENT = "radixserve_1_deadbeef"
WORKER_GREEDY = worker_pb2.ResolvedSampling(temperature=0, top_p=1, top_k=0, max_new_tokens=GREEDY.max_new_tokens)
LONG = {"temperature": 0, "max_new_tokens": 80, "ignore_eos": True}  # keeps a one-request worker busy for seconds
REJECTED = "radixserve_worker_l2_pages_rejected_total"


@dataclass
class Cluster:
    """A started stack: its services, kvcached's address, workers and routers by role."""

    services: LocalServices
    kvcached: str
    workers: dict[str, str]
    routers: dict[str, str]
    metrics_port: int = 0  # worker_queued's Prometheus endpoint


def worker_info(address: str) -> worker_pb2.WorkerInfo:
    return worker_stub(address).GetInfo(worker_pb2.GetInfoRequest(), timeout=5)


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    return status == health_pb2.HealthCheckResponse.SERVING


def worker_idle(address: str) -> bool:
    """Nothing running or queued, and every L1 page held is a cached one: no request kept pages."""
    info = worker_info(address)
    return (info.running_requests, info.waiting_requests, info.kv_pages_used) == (0, 0, info.kv_pages_cached)


def live_leases(kvcached: str) -> int:
    return sum(ns.leases for ns in kvcached_stats(kvcached).namespaces)


def match(kvcached: str, fingerprint: str, ids: list[int], salt: str = "", **flags
          ) -> kvcache_pb2.MatchPrefixResponse:
    request = kvcache_pb2.MatchPrefixRequest(model_fingerprint=fingerprint, cache_salt=salt, token_ids=ids, **flags)
    return kvcache_pb2_grpc.KVCacheStub(grpc.insecure_channel(kvcached)).MatchPrefix(request, timeout=5)


def lease_on(kvcached: str, fingerprint: str, ids: list[int], salt: str = "", ttl_ms: int = 0
             ) -> worker_pb2.L2Lease:
    """A real lease on every full page of `ids`, as the router forwards one."""
    found = match(kvcached, fingerprint, ids, salt, lease=True, lease_ttl_ms=ttl_ms)
    assert found.lease_id and len(found.l2_generations) == len(found.l2_slots) == len(ids) // PAGE
    return worker_pb2.L2Lease(lease_id=found.lease_id, segment_name=found.segment_name, slots=found.l2_slots,
                              generations=found.l2_generations, expires_unix_ms=found.lease_expires_unix_ms)


def token_ids(router: str, messages) -> list[int]:
    return list(router_stub(router).Tokenize(router_pb2.TokenizeRequest(messages=messages), timeout=30).token_ids)


def put_in_l2(router: str, kvcached: str, fingerprint: str, messages, salt: str = "") -> list[int]:
    """Answers `messages` through `router`, then waits until L2 holds every full page of the prompt; its ids."""
    ids = token_ids(router, messages)
    list(router_stub(router).Generate(router_pb2.GenerateRequest(messages=messages, sampling=GREEDY,
                                                                 cache_salt=salt), timeout=120))
    assert wait_for(lambda: match(kvcached, fingerprint, ids, salt).matched_pages == len(ids) // PAGE, 10)
    return ids


def cache_off(router_off: str, prompts) -> list[list[int]]:
    """The reference answers: greedy token ids with every cache off, one prompt at a time."""
    return [list(generate(router_off, p).token_ids) for p in prompts]


def worker_request(ids: list[int], lease: worker_pb2.L2Lease | None = None,
                   sampling: worker_pb2.ResolvedSampling = WORKER_GREEDY) -> worker_pb2.WorkerGenerateRequest:
    return worker_pb2.WorkerGenerateRequest(request_id=uuid.uuid4().hex, prompt_ids=ids, sampling=sampling,
                                            l2_lease=lease)


def generate_on_worker(worker: str, ids: list[int], lease: worker_pb2.L2Lease
                       ) -> list[worker_pb2.WorkerGenerateResponse]:
    """A greedy answer straight from the worker, as the router would ask for it: every streamed message."""
    return list(worker_stub(worker).Generate(worker_request(ids, lease), timeout=120))


def pages_rejected(metrics_port: int) -> dict[str, float]:
    """Leased pages the worker refused to use, by reason."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {s.labels["reason"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == REJECTED}


# -- leases under load, forged leases, kvcached killed --------------------------------------------------------------
@pytest.fixture(scope="module")
def small_l2(tmp_path_factory):
    services = LocalServices(tmp_path_factory.mktemp("integrity-logs"))
    try:
        kvcached = services.kvcached(args=["--host-cache-size-gb", SMALL_L2_GB, "--disk-cache-size-gb", "0"])
        metrics_port = free_port()
        workers = {"warm": services.worker(kvcached, "worker_warm", FLOAT32),
                   "queued": services.worker(kvcached, "worker_queued", [
                       *FLOAT32, "--max-running-requests", "1", "--metrics-port", str(metrics_port)])}
        routers = {"warm": services.router([workers["warm"]], kvcached, "router_warm"),
                   "off": services.router([workers["warm"]], kvcached, "router_off", ["--disable-radix-cache"]),
                   "short": services.router([workers["queued"]], kvcached, "router_short",
                                            ["--lease-ttl-ms", LEASE_TTL_MS])}
        yield Cluster(services, kvcached, workers, routers, metrics_port)
    finally:
        services.stop()


def test_leases_that_expire_while_queued_never_feed_wrong_pages(small_l2):
    c = small_l2
    fingerprint = worker_info(c.workers["queued"]).model.fingerprint
    for seed in range(200, 203):
        put_in_l2(c.routers["warm"], c.kvcached, fingerprint, ask(document(seed, SHORT), "Where does the river bend?"))
    shared = [ask(document(seed, SHORT), "What was lit at dusk?") for seed in range(200, 203)]
    fresh = [ask(document(seed, SHORT), "Who repaired the bell?") for seed in range(203, 208)]
    # The queue's order: each shared prefix after the first waits behind fresh prompts whose commits evict.
    burst = [shared[0], fresh[0], shared[1], fresh[1], shared[2], *fresh[2:]]
    references = cache_off(c.routers["off"], burst)
    before = pages_rejected(c.metrics_port)
    with ThreadPoolExecutor(len(burst)) as pool:
        futures = []
        for prompt in burst:
            futures.append(pool.submit(generate, c.routers["short"], prompt))
            time.sleep(0.05)  # so that arrival order is queue order
        answers = [list(f.result().token_ids) for f in futures]
    assert answers == references
    # shared[1] and shared[2] reached the worker with leases and waited past them.
    assert pages_rejected(c.metrics_port).get("expired", 0) > before.get("expired", 0)
    assert wait_for(lambda: live_leases(c.kvcached) == 0, 10)
    assert wait_for(lambda: worker_idle(c.workers["queued"]), 10)


def forged_leases(c: Cluster, prompts: dict, ids: dict) -> dict[str, worker_pb2.L2Lease]:
    """One lease per reason worker_queued must refuse it, each for a prompt it never computed, named by reason."""
    info = worker_info(c.workers["queued"])
    fingerprint, far = info.model.fingerprint, int(time.time() * 1000) + 60_000

    def synthetic(name: str, segment: str, first_slot: int) -> worker_pb2.L2Lease:
        pages = len(ids[name]) // PAGE
        return worker_pb2.L2Lease(lease_id=f"forged-{name}", segment_name=segment, generations=[1] * pages,
                                  slots=range(first_slot, first_slot + pages), expires_unix_ms=far)

    def real(name: str, salt: str = "", ttl_ms: int = 0) -> worker_pb2.L2Lease:
        put_in_l2(c.routers["warm"], c.kvcached, fingerprint, prompts[name], salt)
        return lease_on(c.kvcached, fingerprint, ids[name], salt, ttl_ms)

    stale = real("generation")
    stale.generations[:] = [g + 1 for g in stale.generations]
    other_tenant = real("key", salt="tenant-b")  # the same tokens' pages under another salt; sent unsalted
    expired = real("expired", ttl_ms=500)  # last, so that the wait below is short
    time.sleep(max(0.0, expired.expires_unix_ms / 1e3 - time.time()) + 0.2)
    return {"segment": synthetic("segment", FORGED_SEGMENT, 0),
            "out_of_range": synthetic("out_of_range", info.kvcached_segment, 10**6),
            "generation": stale, "key": other_tenant, "expired": expired}


def test_forged_and_stale_leases_cost_only_their_own_reuse(small_l2):
    c = small_l2
    worker = c.workers["queued"]
    assert worker_info(worker).kvcached_segment  # registered: the leases name its segment
    names = ("segment", "out_of_range", "generation", "key", "expired", "normal_a", "normal_b")
    prompts = {name: ask(document(210 + i, SHORT), "Which lamp was lit?") for i, name in enumerate(names)}
    ids = {name: token_ids(c.routers["warm"], p) for name, p in prompts.items()}
    references = dict(zip(names, cache_off(c.routers["off"], prompts.values())))
    forged = forged_leases(c, prompts, ids)
    before = pages_rejected(c.metrics_port)
    with ThreadPoolExecutor(len(names)) as pool:
        direct = {name: pool.submit(generate_on_worker, worker, ids[name], lease) for name, lease in forged.items()}
        routed = {name: pool.submit(generate, c.routers["short"], prompts[name]) for name in ("normal_a", "normal_b")}
        for name, future in direct.items():
            responses = future.result()
            assert responses[-1].finish_reason in ("stop", "length"), name
            assert [t for r in responses for t in r.token_ids] == references[name], name
            assert (responses[-1].cached_tokens_l1, responses[-1].cached_tokens_l2) == (0, 0), name
        for name, future in routed.items():
            assert list(future.result().token_ids) == references[name], name
    after = pages_rejected(c.metrics_port)
    rose = {reason: after.get(reason, 0) - before.get(reason, 0) for reason in forged}
    assert all(n >= 1 for n in rose.values()), rose
    # No other request named a foreign segment or a slot past the pool.
    assert rose["segment"] <= len(forged["segment"].slots), rose
    assert rose["out_of_range"] <= len(forged["out_of_range"].slots), rose
    assert wait_for(lambda: live_leases(c.kvcached) == 0, 10)
    assert wait_for(lambda: worker_idle(worker), 10)


def test_a_lease_with_fewer_generations_than_slots_is_invalid_argument(small_l2):
    c = small_l2
    worker = c.workers["queued"]
    ids = token_ids(c.routers["warm"], ask(document(218, SHORT), "Which lamp was lit?"))
    malformed = worker_pb2.L2Lease(lease_id="forged-malformed", segment_name=worker_info(worker).kvcached_segment,
                                   slots=[0, 1], generations=[1], expires_unix_ms=int(time.time() * 1000) + 60_000)
    with pytest.raises(grpc.RpcError) as error:
        generate_on_worker(worker, ids, malformed)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_kill_9_kvcached_under_two_workers_keeps_every_answer_exact(small_l2):
    c = small_l2  # last user of this stack: it stops it
    prompts = [ask(document(230 + i, SHORT), "What did the children count?") for i in range(6)]
    references = cache_off(c.routers["off"], prompts)
    for prompt in prompts[:2]:
        generate(c.routers["warm"], prompt)  # in L2, so that worker_queued gets leases on them
    old = c.services.processes["kvcached"].pid
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(generate, c.routers[router], prompts[i])
                   for i, router in enumerate(("short", "short", "warm", "warm"))]
        assert wait_for(lambda: all(worker_info(w).running_requests for w in c.workers.values()), 20)
        c.services.stop_service("kvcached", signal.SIGKILL)
        answers = [list(f.result().token_ids) for f in futures]
    assert answers == references[:4]

    c.services.start_again("kvcached")
    new = c.services.processes["kvcached"].pid
    assert segments_of({old}) == set()  # the new daemon removed the dead one's pool before serving
    assert c.services.workers_registered(list(c.workers.values()))
    for i in (0, 2, 4, 5):  # computed before the kill (0, 2) and new (4, 5), each through both workers
        for router in ("warm", "short"):
            assert list(generate(c.routers[router], prompts[i]).token_ids) == references[i], (i, router)

    c.services.stop()
    assert segments_of({old, new}) == set()


# -- a worker restarted with another dtype --------------------------------------------------------------------------
@pytest.fixture
def dtype_swap(tmp_path):
    services = LocalServices(tmp_path)
    try:
        kvcached = services.kvcached(args=["--host-cache-size-gb", "0.1", "--disk-cache-size-gb", "0"])
        worker = services.worker(kvcached, "worker_dtype", FLOAT32)
        routers = {"on": services.router([worker], kvcached, "router_dtype"),
                   "off": services.router([worker], kvcached, "router_dtype_off", ["--disable-radix-cache"])}
        yield Cluster(services, kvcached, {"dtype": worker}, routers)
    finally:
        services.stop()


def test_worker_restarted_in_another_dtype_never_reuses_the_old_pages(dtype_swap):
    c = dtype_swap
    worker = c.workers["dtype"]
    prompts = [ask(document(220 + i, 8), "Which lamp was lit?") for i in range(2)]
    float32_fingerprint = worker_info(worker).model.fingerprint
    for prompt in prompts:  # float32 pages in the worker's L1 and in kvcached's L2
        put_in_l2(c.routers["on"], c.kvcached, float32_fingerprint, prompt)

    assert c.services.stop_service("worker_dtype") == 0
    c.services.start_again("worker_dtype", ["--dtype", "bfloat16"])
    assert c.services.workers_registered([worker])
    assert wait_for(lambda: serving(c.routers["on"]) and serving(c.routers["off"]))  # their health watch saw it back
    assert worker_info(worker).model.dtype == "bfloat16"
    references = cache_off(c.routers["off"], prompts)  # the bfloat16 worker's own answers
    for prompt, reference in zip(prompts, references):
        answer = generate(c.routers["on"], prompt)
        assert list(answer.token_ids) == reference
        assert answer.usage.cached_tokens == 0  # nothing of float32 (L2) or of the old process (L1) is reused


# -- leases released on every path --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiers(tmp_path_factory):
    services = LocalServices(tmp_path_factory.mktemp("integrity-tiers-logs"))
    try:
        kvcached = services.kvcached()
        worker = services.worker(kvcached, "worker_single", [*FLOAT32, "--max-running-requests", "1"])
        routers = {"plain": services.router([worker], kvcached, "router_plain"),
                   "wait": services.router([worker], kvcached, "router_wait",
                                           ["--prefetch-policy", "wait_complete"])}
        yield Cluster(services, kvcached, {"single": worker}, routers)
    finally:
        services.stop()


def test_lease_released_when_the_client_cancels_during_the_prefetch_wait(tiers):
    c = tiers
    worker = c.workers["single"]
    fingerprint = worker_info(worker).model.fingerprint
    prompt = ask(document(240), "Who keeps the ledger?")
    ids = token_ids(c.routers["plain"], prompt)
    generate(c.routers["plain"], prompt)
    assert wait_for(lambda: kvcached_stats(c.kvcached).disk.blocks >= len(ids) // PAGE)
    # SIGTERM flushes L3; the new daemon's L2 is empty and its disk slow. Slow reads would make it judge L3 not
    # worth loading; say recompute is slower still.
    assert c.services.stop_service("kvcached") == 0
    c.services.start_again("kvcached", ["--l3-read-delay-ms", str(READ_DELAY_MS), "--recompute-tokens-per-s", "20"])
    assert c.services.workers_registered([worker])
    # The front pages back in L2, so the router's first match leases them while the rest loads.
    front = match(c.kvcached, fingerprint, ids[:FRONT_PAGES * PAGE], prefetch=True)
    assert front.prefetch_id
    kvcache_pb2_grpc.KVCacheStub(grpc.insecure_channel(c.kvcached)).WaitPrefetch(
        kvcache_pb2.WaitPrefetchRequest(prefetch_id=front.prefetch_id, timeout_ms=10_000), timeout=15)
    probe = match(c.kvcached, fingerprint, ids)
    assert (probe.matched_pages, probe.l3_pages) == (FRONT_PAGES, len(ids) // PAGE - FRONT_PAGES)

    call = router_stub(c.routers["wait"]).Generate(
        router_pb2.GenerateRequest(messages=prompt, sampling=GREEDY, stream=True), timeout=60)
    assert wait_for(lambda: live_leases(c.kvcached) >= 1, 5)
    time.sleep(0.3)  # past the match's reply: the router is waiting on the prefetch (~3 s of reads)
    call.cancel()
    assert wait_for(lambda: live_leases(c.kvcached) == 0, 10)


def test_lease_released_when_a_queued_request_is_cancelled(tiers):
    c = tiers
    worker = c.workers["single"]
    fingerprint = worker_info(worker).model.fingerprint
    queued_ids = put_in_l2(c.routers["plain"], c.kvcached, fingerprint, ask(document(242, SHORT), "Who repaired it?"))
    busy_ids = token_ids(c.routers["plain"], ask(document(241, SHORT), "Count the boats."))
    long_run = worker_pb2.ResolvedSampling(top_p=1, **LONG)
    busy = worker_stub(worker).Generate(worker_request(busy_ids, sampling=long_run), timeout=120)
    next(busy)  # running: the next request queues behind it
    queued = worker_stub(worker).Generate(worker_request(queued_ids, lease_on(c.kvcached, fingerprint, queued_ids)),
                                          timeout=120)
    assert wait_for(lambda: worker_info(worker).waiting_requests == 1, 10)
    assert live_leases(c.kvcached) == 1
    queued.cancel()
    assert wait_for(lambda: live_leases(c.kvcached) == 0, 10)  # well before the lease's 30 s TTL
    busy.cancel()
    assert wait_for(lambda: worker_idle(worker), 10)


def test_lease_released_when_the_worker_dies_under_it(tiers):
    c = tiers  # last user of this stack: it kills the worker
    worker = c.workers["single"]
    router = router_stub(c.routers["plain"])
    queued_prompt = ask(document(244, SHORT), "Who repaired it?")
    put_in_l2(c.routers["plain"], c.kvcached, worker_info(worker).model.fingerprint, queued_prompt)
    busy = router.Generate(router_pb2.GenerateRequest(messages=ask(document(243, SHORT), "Count the boats."),
                                                      sampling=router_pb2.SamplingParams(**LONG), stream=True),
                           timeout=120)
    next(busy)
    queued = router.Generate(router_pb2.GenerateRequest(messages=queued_prompt, sampling=GREEDY, stream=True),
                             timeout=120)
    assert wait_for(lambda: worker_info(worker).waiting_requests == 1 and live_leases(c.kvcached) == 1, 10)
    c.services.stop_service("worker_single", signal.SIGKILL)
    for call in (busy, queued):
        with pytest.raises(grpc.RpcError) as error:
            list(call)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert wait_for(lambda: live_leases(c.kvcached) == 0, 10)  # well before the lease's 30 s TTL
