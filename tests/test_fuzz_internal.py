"""The internal services under generated requests and raw bytes, through real processes: kvcached's RPCs and the
worker's Generate. Every call ends well inside its deadline with a status the service documents (never UNKNOWN or
INTERNAL), and afterwards both still serve: kvcached answers GetStats, passes its idle integrity check, and caches
and matches a fresh namespace; the worker gives the greedy answer it gave before.

Requests for kvcached draw on what earlier answers returned (segments, allocations, leases, prefetches), so that
commits, releases and waits reach real state and not only the "unknown id" paths. Fingerprints come from a fixed
set: each one registered creates an L2 pool, so the daemon's pools stay few and small (`POOL_GB`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.blocks.geometry import LAYOUT
from radixserve.launch import LocalServices
from radixserve.v1 import common_pb2, kvcache_pb2, kvcache_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.test_fuzz_router import (
    DEADLINE_S,
    FUZZ,
    INF,
    NAN,
    UNICODE,
    VOCAB,
    Tally,
    call,
    check_refusal,
    f32,
    short_text,
    uint32,
)

pytestmark = pytest.mark.e2e

CASES = 1000
GARBAGE_CASES = 300
POOL_GB = 0.05  # per namespace: 72 of the worker's 720 KiB blocks, 52k of a 1 KiB test geometry
PAGE = 16  # kvcached's and the worker's default page size
KVCACHE_ALLOWED = frozenset({grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                             grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED})
WORKER_ALLOWED = frozenset({grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED})
KVCACHE_METHODS = ("RegisterNamespace", "MatchPrefix", "AllocateSlots", "CommitBlocks", "ReleaseLease",
                   "WaitPrefetch", "DropNamespace", "GetStats")
SMALL_GEO = common_pb2.BlockGeometry(num_layers=2, num_kv_heads=1, head_dim=4, page_size=PAGE, dtype="float32",
                                     layout=LAYOUT)  # 1 KiB blocks
U64 = st.one_of(st.sampled_from([0, 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))


@dataclass
class Internal:
    services: LocalServices
    kvcached: str
    worker: str
    info: worker_pb2.WorkerInfo

    def kvcache(self) -> kvcache_pb2_grpc.KVCacheStub:
        return kvcache_pb2_grpc.KVCacheStub(grpc.insecure_channel(self.kvcached))

    def log(self, name: str) -> str:
        return (self.services.log_dir / f"{name}.log").read_text()


@pytest.fixture(scope="module")
def internal(tmp_path_factory):
    services = LocalServices(tmp_path_factory.mktemp("logs"))
    try:
        kvcached = services.kvcached(args=["--host-cache-size-gb", str(POOL_GB)])
        # float32: 364 pages of 0.25 GiB, fewer than a context-long request needs, so the huge max_new_tokens
        # cases are refused (bfloat16 would admit them and decode for minutes)
        worker = services.worker(kvcached, args=["--dtype", "float32"])
        stub = worker_stub(worker)
        assert services.workers_registered([worker])
        yield Internal(services, kvcached, worker, stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10))
    finally:
        services.stop()


@pytest.fixture(scope="module")
def tallies():
    found: dict[str, Tally] = {}
    yield found
    print("\n" + "\n".join(t.report(name) for name, t in found.items()))


def worker_stub(address: str) -> worker_pb2_grpc.WorkerStub:
    return worker_pb2_grpc.WorkerStub(grpc.insecure_channel(address))


# -- kvcached -----------------------------------------------------------------------------------------------------

@dataclass
class Seen:
    """What kvcached's answers named, for later requests to use."""

    segments: set[str] = field(default_factory=set)
    allocations: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # id -> (fingerprint, slots)
    leases: set[str] = field(default_factory=set)
    prefetches: set[str] = field(default_factory=set)

    def note(self, method: str, request, response) -> None:
        if method == "RegisterNamespace":
            self.segments.add(response.segment_name)
        elif method == "MatchPrefix":
            self.leases.update({response.lease_id} - {""})
            self.prefetches.update({response.prefetch_id} - {""})
        elif method == "AllocateSlots":
            self.allocations[response.allocation_id] = (request.model_fingerprint, tuple(response.slots))


def seen_or(draw, values, fallback):
    """One of `values` (when there are any) or a draw of `fallback`. The same draws whatever `values` holds:
    hypothesis replays a case's choices and refuses data generation whose shape depends on outside state."""
    index, use_seen, other = draw(st.integers(0, 1 << 16)), draw(st.booleans()), draw(fallback)
    return sorted(values)[index % len(values)] if values and use_seen else other


def kvcache_requests(data, method: str, fingerprints: list[str], geometries: list[common_pb2.BlockGeometry],
                     seen: Seen):
    """One generated request for `method`; `geometries` are valid ones (the worker's, a small one)."""
    draw = data.draw
    fingerprint = st.sampled_from(fingerprints)
    salt = st.one_of(st.text(UNICODE, max_size=8), st.sampled_from(["", "s" * 300]))
    # A small alphabet makes pages repeat, so that matches and commits meet cached prefixes.
    token_ids = st.one_of(st.lists(st.integers(0, 3), max_size=5 * PAGE), st.lists(uint32, max_size=20),
                          st.sampled_from([[7] * 100_000]))
    ident = st.one_of(st.text(UNICODE, max_size=12), st.sampled_from(["", "x" * 10_000]))
    if method == "RegisterNamespace":
        dims = st.one_of(st.sampled_from([0, 1, 2, 30, 2**32 - 1]), st.integers(0, 2**32 - 1))
        geometry = st.one_of(
            st.sampled_from(geometries),
            st.builds(common_pb2.BlockGeometry, num_layers=dims, num_kv_heads=dims, head_dim=dims,
                      page_size=st.sampled_from([0, 4, PAGE, 2**32 - 1]),
                      dtype=st.sampled_from(["float32", "bfloat16", "float16", "", "int8", "float32\x00"]),
                      layout=st.one_of(st.sampled_from([LAYOUT, ""]), short_text)))
        return kvcache_pb2.RegisterNamespaceRequest(model_fingerprint=draw(fingerprint),
                                                    geometry=draw(st.none() | geometry))
    if method == "MatchPrefix":
        return kvcache_pb2.MatchPrefixRequest(
            model_fingerprint=draw(fingerprint), cache_salt=draw(salt), token_ids=draw(token_ids),
            lease=draw(st.booleans()), prefetch=draw(st.booleans()),
            lease_ttl_ms=draw(st.one_of(st.sampled_from([0, 1, 1000, 300_000, 300_001, 2**32 - 1]), uint32)))
    if method == "AllocateSlots":
        return kvcache_pb2.AllocateSlotsRequest(
            model_fingerprint=draw(fingerprint), segment_name=seen_or(draw, seen.segments, ident),
            count=draw(st.one_of(st.sampled_from([0, 1, 2, 4, 1024, 1025, 2**32 - 1]), uint32)))
    if method == "CommitBlocks":
        request = kvcache_pb2.CommitBlocksRequest(
            model_fingerprint=draw(fingerprint), cache_salt=draw(salt), token_ids=draw(token_ids),
            first_page=draw(uint32), slots=draw(st.lists(st.integers(0, 100) | uint32, max_size=8)),
            allocation_id=seen_or(draw, seen.allocations, ident))
        well_formed, keep = draw(st.booleans()), draw(st.lists(st.booleans(), min_size=8, max_size=8))
        pages, first_page = draw(st.lists(st.integers(0, 3), max_size=12)), draw(st.sampled_from([0, 0, 1, 2**32 - 1]))
        if well_formed and request.allocation_id in seen.allocations:
            # some of the allocation's slots, for the pages of a prompt long enough to hold them
            owner, slots = seen.allocations[request.allocation_id]
            slots = [slot for slot, kept in zip(slots, keep + [True] * len(slots)) if kept]
            pages += [0] * max(0, min(first_page, 4) + len(slots) - len(pages))
            request.model_fingerprint, request.first_page = owner, first_page
            request.token_ids[:] = [p for p in pages for _ in range(PAGE)]
            request.slots[:] = slots
        return request
    if method == "ReleaseLease":
        return kvcache_pb2.ReleaseLeaseRequest(lease_id=seen_or(draw, seen.leases, ident))
    if method == "WaitPrefetch":
        return kvcache_pb2.WaitPrefetchRequest(prefetch_id=seen_or(draw, seen.prefetches, ident),
                                               timeout_ms=draw(st.sampled_from([0, 1, 50, 2**32 - 1])))
    if method == "DropNamespace":
        return kvcache_pb2.DropNamespaceRequest(model_fingerprint=draw(fingerprint))
    return kvcache_pb2.GetStatsRequest()


def check_kvcache_answer(method: str, request, response) -> None:
    if method == "MatchPrefix":
        assert response.matched_pages <= len(request.token_ids) // PAGE
        assert len(response.l2_slots) == len(response.l2_generations) == response.matched_pages
    elif method == "AllocateSlots":
        assert len(response.slots) <= request.count and len(set(response.slots)) == len(response.slots)


def test_kvcached_rpcs_end_with_documented_statuses(internal, tallies):
    tally = tallies.setdefault("kvcached, generated requests", Tally())
    stub = internal.kvcache()
    fingerprints = ["fuzz-a", "fuzz-b", "", "é" * 40, "f" * 70_000, internal.info.model.fingerprint]
    geometries = [SMALL_GEO, common_pb2.BlockGeometry(num_layers=30, num_kv_heads=3, head_dim=64, page_size=PAGE,
                                                      dtype=internal.info.model.dtype, layout=LAYOUT)]
    seen = Seen()

    @FUZZ
    @given(data=st.data())
    def case(data) -> None:
        method = data.draw(st.sampled_from(KVCACHE_METHODS))
        request = kvcache_requests(data, method, fingerprints, geometries, seen)
        code, responses = call(tally, lambda: getattr(stub, method)(request, timeout=DEADLINE_S), KVCACHE_ALLOWED)
        tally.finishes[f"{method} {code.name}"] += 1
        if code == grpc.StatusCode.OK:
            seen.note(method, request, responses[0])
            check_kvcache_answer(method, request, responses[0])

    case()
    assert sum(tally.codes.values()) >= CASES
    check_kvcached_still_serves(internal)


def test_kvcached_raw_bytes_end_with_documented_statuses(internal, tallies):
    tally = tallies.setdefault("kvcached, raw bytes", Tally())
    channel = grpc.insecure_channel(internal.kvcached)
    calls = {m: channel.unary_unary(f"/radixserve.v1.KVCache/{m}", request_serializer=None,
                                    response_deserializer=None) for m in KVCACHE_METHODS}
    requests = {"MatchPrefix": kvcache_pb2.MatchPrefixRequest(model_fingerprint="fuzz-a", token_ids=[1] * 40),
                "CommitBlocks": kvcache_pb2.CommitBlocksRequest(model_fingerprint="fuzz-a", slots=[1, 2]),
                "AllocateSlots": kvcache_pb2.AllocateSlotsRequest(model_fingerprint="fuzz-a", count=3),
                "WaitPrefetch": kvcache_pb2.WaitPrefetchRequest(prefetch_id="p", timeout_ms=5)}

    @settings(FUZZ, max_examples=GARBAGE_CASES)
    @given(method=st.sampled_from(KVCACHE_METHODS), data=st.data())
    def case(method: str, data) -> None:
        # Not RegisterNamespace with a mutated request: every fingerprint it made up would get a pool.
        base = requests.get(method)
        blob = data.draw(st.binary(max_size=256) if base is None else st.one_of(st.binary(max_size=256),
                                                                                  mutated(base)))
        call(tally, lambda: calls[method](blob, timeout=DEADLINE_S), KVCACHE_ALLOWED)

    case()
    check_kvcached_still_serves(internal)


def mutated(message) -> st.SearchStrategy[bytes]:
    data = message.SerializeToString()

    def flip(changes: list[tuple[int, int]]) -> bytes:
        out = bytearray(data)
        for at, value in changes:
            out[at % len(out)] = value
        return bytes(out)

    return st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=4).map(flip)


IDLE_CHECK_S = 5.0  # kvcached checks its integrity after this long without an RPC


def check_kvcached_still_serves(internal: Internal) -> None:
    stub = internal.kvcache()
    time.sleep(IDLE_CHECK_S + 2)  # let the idle integrity check run
    log = internal.log("kvcached")
    assert "integrity check failed" not in log and "housekeeping failed" not in log
    assert "unhandled error" not in log
    assert stub.GetStats(kvcache_pb2.GetStatsRequest(), timeout=10).disk.enabled
    fingerprint = f"after-fuzz-{time.monotonic_ns()}"
    pool = stub.RegisterNamespace(kvcache_pb2.RegisterNamespaceRequest(model_fingerprint=fingerprint,
                                                                       geometry=SMALL_GEO), timeout=10)
    allocation = stub.AllocateSlots(kvcache_pb2.AllocateSlotsRequest(
        model_fingerprint=fingerprint, segment_name=pool.segment_name, count=2), timeout=10)
    ids = [5] * PAGE + [6] * PAGE + [7] * 3
    commit = stub.CommitBlocks(kvcache_pb2.CommitBlocksRequest(
        model_fingerprint=fingerprint, token_ids=ids, first_page=0, slots=allocation.slots,
        allocation_id=allocation.allocation_id), timeout=10)
    assert (commit.inserted, commit.already_cached) == (2, 0)
    match = stub.MatchPrefix(kvcache_pb2.MatchPrefixRequest(model_fingerprint=fingerprint, token_ids=ids),
                             timeout=10)
    assert (match.matched_pages, list(match.l2_slots)) == (2, list(allocation.slots))


# -- the worker ---------------------------------------------------------------------------------------------------

GREEDY = worker_pb2.ResolvedSampling(temperature=0, top_p=1, max_new_tokens=8)


def worker_answer(internal: Internal) -> list[int]:
    request = worker_pb2.WorkerGenerateRequest(request_id=f"greedy-{time.monotonic_ns()}",
                                               prompt_ids=[1, 504, 3458, 282, 4649, 30, 2], sampling=GREEDY)
    return [t for r in worker_stub(internal.worker).Generate(request, timeout=120) for t in r.token_ids]


@pytest.fixture(scope="module")
def worker_answer_before(internal) -> list[int]:
    answer = worker_answer(internal)
    assert len(answer) == 8
    return answer


def leases(segment: str):
    """Leases naming the worker's own segment or others, slots in and out of its range, one generation per slot or
    not, expiring never (0 and 2^64-1), already, or in 10 s."""

    @st.composite
    def lease(draw) -> worker_pb2.L2Lease:
        n = draw(st.integers(0, 4))
        slots = draw(st.lists(st.integers(0, 80) | uint32, min_size=n, max_size=n))
        generations = draw(st.one_of(st.lists(U64, min_size=n, max_size=n), st.lists(U64, max_size=5)))
        now_ms = int(time.time() * 1e3)
        expires = draw(st.sampled_from([0, 2**64 - 1, now_ms - 1_000, now_ms + 10_000]))
        return worker_pb2.L2Lease(
            lease_id=draw(st.text(UNICODE, max_size=12)), slots=slots, generations=generations,
            segment_name=draw(st.one_of(st.sampled_from([segment, "", "radixserve_1_dead", "../../etc/passwd"]),
                                        short_text)), expires_unix_ms=expires)

    return lease()


def worker_requests(segment: str, valid: bool):
    """Generated WorkerGenerateRequests; `valid` ones are within every limit (and ask for 1-2 tokens). A valid
    max_new_tokens is 1 or 2 either way: 100,000 and 2^32-1 are refused, since at any prompt length they need more
    pages than the worker's 0.25 GiB pool holds."""
    if valid:
        prompt = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)
        temperature = st.one_of(st.sampled_from([0.0, 1e-40, 1e-6, 1e-5, 1.0, 3.4e38, INF]),
                                st.floats(0, 100, width=32))
        top_p = st.one_of(st.sampled_from([1e-9, 0.5, 1.0]), st.floats(0, 1, exclude_min=True, width=32))
        max_new = st.sampled_from([1, 2])
    else:
        prompt = st.one_of(st.lists(st.integers(0, VOCAB - 1), max_size=24), st.lists(uint32, max_size=8),
                           st.sampled_from([[28] * 8192, [28] * 8193, [1] * 100_000]))
        # NaN is left out here: see test_a_nan_temperature_is_refused_or_sampled.
        temperature = st.one_of(st.none(), st.sampled_from([0.0, -0.0, 1e-40, 1e-6, 2.0, 3.4e38, -1.0, INF, -INF]),
                                st.floats(width=32, allow_nan=False))
        top_p = f32(0.0, 1e-9, 0.5, 1.0, 1.0000001, 2.0, -1.0, NAN, INF)
        max_new = st.sampled_from([0, 1, 2, 100_000, 2**32 - 1])

    @st.composite
    def request(draw) -> worker_pb2.WorkerGenerateRequest:
        fields = dict(temperature=draw(temperature), top_p=draw(top_p), top_k=draw(uint32),
                      max_new_tokens=draw(max_new), seed=draw(st.none() | U64), ignore_eos=draw(st.booleans()),
                      stop=draw(st.one_of(st.lists(st.text(UNICODE, max_size=8), max_size=4),
                                          st.sampled_from([["s" * 10_000], ["s"] * 100]))))
        sampling = worker_pb2.ResolvedSampling(**{k: v for k, v in fields.items() if v is not None})
        return worker_pb2.WorkerGenerateRequest(
            request_id=draw(st.one_of(st.text(UNICODE, max_size=12), st.sampled_from(["", "r" * 10_000]))),
            prompt_ids=draw(prompt), sampling=draw(st.just(sampling) if valid else st.none() | st.just(sampling)),
            cache_salt=draw(st.text(UNICODE, max_size=8)), disable_cache=draw(st.booleans()),
            l2_lease=draw(st.none() | leases(segment)))

    return request()


def test_worker_generate_ends_with_documented_statuses(internal, worker_answer_before, tallies):
    tally = tallies.setdefault("Worker/Generate, generated requests", Tally())
    stub = worker_stub(internal.worker)
    segment = internal.info.kvcached_segment
    requests = st.one_of(*[worker_requests(segment, valid=False)] * 3, worker_requests(segment, valid=True))

    @FUZZ
    @given(request=requests)
    def case(request: worker_pb2.WorkerGenerateRequest) -> None:
        code, responses = call(tally, lambda: stub.Generate(request, timeout=DEADLINE_S), WORKER_ALLOWED)
        if code == grpc.StatusCode.OK:
            last = responses[-1]
            tally.finishes[last.finish_reason] += 1
            assert last.finish_reason in ("stop", "length")
            assert sum(len(r.token_ids) for r in responses) <= request.sampling.max_new_tokens

    case()
    assert sum(tally.codes.values()) >= CASES
    assert worker_answer(internal) == worker_answer_before


FAST = worker_pb2.WorkerGenerateRequest(sampling=worker_pb2.ResolvedSampling(max_new_tokens=1)).SerializeToString()


def test_worker_raw_bytes_end_with_documented_statuses(internal, worker_answer_before, tallies):
    tally = tallies.setdefault("Worker/Generate, raw bytes", Tally())
    generate = grpc.insecure_channel(internal.worker).unary_stream(
        "/radixserve.v1.Worker/Generate", request_serializer=None, response_deserializer=None)
    base = worker_pb2.WorkerGenerateRequest(
        request_id="r", prompt_ids=[1, 2, 3], sampling=worker_pb2.ResolvedSampling(top_p=1, max_new_tokens=1),
        l2_lease=worker_pb2.L2Lease(lease_id="l", segment_name=internal.info.kvcached_segment, slots=[1],
                                    generations=[1], expires_unix_ms=2**64 - 1))

    @settings(FUZZ, max_examples=GARBAGE_CASES)
    @given(blob=st.one_of(st.binary(max_size=256), mutated(base)))
    def case(blob: bytes) -> None:
        try:
            worker_pb2.WorkerGenerateRequest.FromString(blob)
            blob += FAST  # it parses: whatever it asks, one token at most (the last value of a field wins)
        except Exception:  # noqa: BLE001, S110 -- protobuf's DecodeError: the worker must refuse it
            pass
        call(tally, lambda: generate(blob, timeout=DEADLINE_S), WORKER_ALLOWED)

    case()
    assert worker_answer(internal) == worker_answer_before


def test_a_long_refusal_from_kvcached_or_the_worker_is_one_bounded_line(internal):
    with pytest.raises(grpc.RpcError) as err:
        internal.kvcache().CommitBlocks(kvcache_pb2.CommitBlocksRequest(
            model_fingerprint=internal.info.model.fingerprint, allocation_id="a" * 10_000), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    check_refusal(err.value)


def test_a_nan_temperature_is_refused_or_sampled(internal):
    request = worker_pb2.WorkerGenerateRequest(
        request_id="nan", prompt_ids=[1, 2, 3], sampling=worker_pb2.ResolvedSampling(temperature=NAN, top_p=1,
                                                                                     max_new_tokens=1))
    try:
        responses = list(worker_stub(internal.worker).Generate(request, timeout=DEADLINE_S))
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        return
    assert responses[-1].finish_reason in ("stop", "length")
