"""radixserve.server's status mapping and limits, through a real grpc.aio server in this process.

A stand-in Router servicer behaves as its request's `text` says; it is hosted by `make_server` (what `serve` runs)
on a loop in a background thread, and called with ordinary blocking stubs, as clients call the real services.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from radixserve.launch import wait_for
from radixserve.server import MAX_DETAILS_CHARS, MAX_MESSAGE_BYTES, ServiceError, make_server, retry_after_s
from radixserve.v1 import router_pb2, router_pb2_grpc

SMALL_MESSAGE_BYTES = 64 << 10
SMALL_CONCURRENT_RPCS = 4
BUSY = "worker overloaded: 16 requests running"


class Behaviour(router_pb2_grpc.RouterServicer):
    """Tokenize (unary) and Generate (server-streaming) act as `request.text` says."""

    def __init__(self) -> None:
        self.in_slow = 0
        self.release = asyncio.Event()

    async def Tokenize(self, request, context):
        await self._act(request.text)
        return router_pb2.TokenizeResponse(token_ids=[len(request.text)])

    async def Generate(self, request, context):
        if request.text.endswith("after-first"):
            yield router_pb2.GenerateResponse(text="first")
        await self._act(request.text.removesuffix("-after-first"))
        yield router_pb2.GenerateResponse(text="done", finish_reason="stop")

    async def _act(self, text: str) -> None:
        if text == "overload":
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, BUSY, retry_after_s=1.5)
        if text == "invalid":
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "text is wrong")
        if text == "long":
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "text is wrong: " + "é" * 100_000)
        if text == "boom":
            raise RuntimeError("secret detail\n  File \"x.py\", line 1")
        if text == "slow":
            self.in_slow += 1
            await self.release.wait()


class Servers:
    """`small` with SMALL_MESSAGE_BYTES and SMALL_CONCURRENT_RPCS; `default` with make_server's defaults."""

    def __init__(self) -> None:
        self.behaviour: Behaviour | None = None
        self.loop = asyncio.new_event_loop()
        self.addresses: dict[str, str] = {}
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),), daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    async def _main(self) -> None:
        self.behaviour = Behaviour()
        self._stop = asyncio.Event()
        servers = {"small": make_server(SMALL_MESSAGE_BYTES, SMALL_CONCURRENT_RPCS), "default": make_server()}
        health_servicer = health.aio.HealthServicer()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        for name, server in servers.items():
            router_pb2_grpc.add_RouterServicer_to_server(self.behaviour, server)
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
            self.addresses[name] = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
        self._ready.set()
        await self._stop.wait()
        for server in servers.values():
            await server.stop(0)

    def stub(self, name: str = "small") -> router_pb2_grpc.RouterStub:
        return router_pb2_grpc.RouterStub(grpc.insecure_channel(self.addresses[name]))

    def raw(self, method: str, name: str = "small"):
        """A call of `method` that sends bytes as they are."""
        channel = grpc.insecure_channel(self.addresses[name])
        path = f"/radixserve.v1.Router/{method}"
        return channel.unary_stream(path) if method == "Generate" else channel.unary_unary(path)

    def release_slow(self) -> None:
        self.loop.call_soon_threadsafe(self.behaviour.release.set)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    running = Servers()
    yield running
    running.close()


def tokenize(servers: Servers, text: str, name: str = "small") -> router_pb2.TokenizeResponse:
    return servers.stub(name).Tokenize(router_pb2.TokenizeRequest(text=text), timeout=10)


def generate(servers: Servers, text: str) -> list[router_pb2.GenerateResponse]:
    return list(servers.stub().Generate(router_pb2.GenerateRequest(text=text), timeout=10))


def failure(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def retry_info(err: grpc.RpcError) -> error_details_pb2.RetryInfo:
    status = rpc_status.from_call(err)
    assert status is not None, "no grpc-status-details-bin trailer"
    assert (status.code, status.message) == (err.code().value[0], err.details())
    (detail,) = status.details
    info = error_details_pb2.RetryInfo()
    assert detail.Unpack(info)
    return info


def test_overload_in_a_unary_call_carries_retry_info(servers):
    err = failure(lambda: tokenize(servers, "overload"))
    assert (err.code(), err.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, BUSY)
    delay = retry_info(err).retry_delay
    assert (delay.seconds, delay.nanos) == (1, 500_000_000)
    assert retry_after_s(err) == 1.5


@pytest.mark.parametrize("text", ["overload", "overload-after-first"])
def test_overload_in_a_stream_carries_retry_info_before_and_after_the_first_message(servers, text):
    received: list[router_pb2.GenerateResponse] = []

    def consume():
        for response in servers.stub().Generate(router_pb2.GenerateRequest(text=text), timeout=10):
            received.append(response)

    err = failure(consume)
    assert [r.text for r in received] == (["first"] if text.endswith("after-first") else [])
    assert (err.code(), err.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, BUSY)
    assert retry_after_s(err) == 1.5 and retry_info(err).retry_delay.seconds == 1


def test_an_error_without_a_delay_has_no_details_trailer(servers):
    err = failure(lambda: tokenize(servers, "invalid"))
    assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "text is wrong")
    assert rpc_status.from_call(err) is None and retry_after_s(err) is None


@pytest.mark.parametrize("retry_after", [-1.0, float("nan"), float("inf")])
def test_a_retry_delay_must_be_finite_and_not_negative(retry_after):
    with pytest.raises(ValueError, match="retry_after_s"):
        ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", retry_after_s=retry_after)


def test_a_long_message_is_cut_so_that_the_trailer_fits(servers):
    # Uncut, 100,000 "é" percent-encode to 600 kB of trailer: the client would see RESOURCE_EXHAUSTED "Stream
    # removed (received metadata size exceeds hard limit)" instead of the status.
    err = failure(lambda: tokenize(servers, "long"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("text is wrong: ééé") and err.details().endswith("...")
    assert len(err.details()) == MAX_DETAILS_CHARS


@pytest.mark.parametrize("call", ["unary", "stream", "stream-after-first"])
def test_an_unhandled_exception_is_internal_in_one_line_without_the_traceback(servers, call):
    if call == "unary":
        err = failure(lambda: tokenize(servers, "boom"))
    else:
        err = failure(lambda: generate(servers, "boom" + ("-after-first" if call.endswith("first") else "")))
    method = "Tokenize" if call == "unary" else "Generate"
    assert err.code() == grpc.StatusCode.INTERNAL
    assert err.details() == f"internal error in /radixserve.v1.Router/{method}: RuntimeError"
    assert rpc_status.from_call(err) is None


def test_an_oversized_request_is_refused_by_grpc(servers):
    err = failure(lambda: tokenize(servers, "x" * SMALL_MESSAGE_BYTES))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in err.details()
    assert tokenize(servers, "x" * (SMALL_MESSAGE_BYTES - 16)).token_ids == [SMALL_MESSAGE_BYTES - 16]


def test_the_default_message_limit_is_max_message_bytes(servers):
    assert MAX_MESSAGE_BYTES == 4 << 20
    err = failure(lambda: tokenize(servers, "x" * MAX_MESSAGE_BYTES, name="default"))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in err.details()
    assert tokenize(servers, "x" * (1 << 20), name="default").token_ids == [1 << 20]


def test_rpcs_past_the_concurrency_limit_are_refused_by_grpc(servers):
    stub = servers.stub()
    slow = [stub.Tokenize.future(router_pb2.TokenizeRequest(text="slow"), timeout=30)
            for _ in range(SMALL_CONCURRENT_RPCS)]
    try:
        assert wait_for(lambda: servers.behaviour.in_slow == SMALL_CONCURRENT_RPCS, 10), "the slow calls never arrived"
        err = failure(lambda: tokenize(servers, "fast"))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        servers.release_slow()
    assert [f.result().token_ids for f in slow] == [[4]] * SMALL_CONCURRENT_RPCS
    assert tokenize(servers, "fast").token_ids == [4]


# Bytes that are not a TokenizeRequest / GenerateRequest. protobuf (upb) refuses invalid UTF-8 in a proto3 string
# field at parse time; grpc.aio alone would answer UNKNOWN "Unexpected <class DecodeError>".
UNDECODABLE = [
    (b"\x0a\x02\xff\xfe", "bad UTF-8"),  # text = two bytes that are not UTF-8
    (b"\x0a\x03\xed\xa0\x80", "bad UTF-8"),  # text = an encoded lone surrogate (U+D800)
    (b"\x0a\x10hi", "Error parsing message"),  # text's length runs past the end
    (b"\xff\xff\xff\xff", "Error parsing message"),
]


@pytest.mark.parametrize("method", ["Tokenize", "Generate"])
@pytest.mark.parametrize("data,message", UNDECODABLE, ids=[repr(d) for d, _ in UNDECODABLE])
def test_a_request_that_does_not_decode_is_invalid_argument(servers, method, data, message):
    call = servers.raw(method)
    err = failure(lambda: list(call(data, timeout=10)) if method == "Generate" else call(data, timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.details() and err.details().startswith("the request is not a valid message")
    ok = router_pb2.TokenizeRequest(text="hi").SerializeToString()
    assert router_pb2.TokenizeResponse.FromString(servers.raw("Tokenize")(ok, timeout=10)).token_ids == [2]


def test_a_stream_handler_that_writes_instead_of_yielding_is_served(servers):
    # grpc_health's Watch is a coroutine calling context.write(): the interceptor must not iterate it.
    watch = health_pb2_grpc.HealthStub(grpc.insecure_channel(servers.addresses["default"])).Watch(
        health_pb2.HealthCheckRequest(), timeout=10)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
