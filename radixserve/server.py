"""The gRPC wiring every radixserve process shares: logging, status mapping, health, reflection, metrics, shutdown.

A servicer raises `ServiceError(code, message)` for anything the client did wrong or that cannot be served now; the
`StatusInterceptor` turns it into that status and message. With `retry_after_s` (overload) the status also carries a
`google.rpc.RetryInfo` detail in the standard rich-status trailer (`grpc-status-details-bin`), which a client reads
with `grpc_status.rpc_status.from_call` (or `retry_after_s` here). Any other exception is logged with its traceback
and the client gets INTERNAL with a one-line message, never the traceback. A request that does not decode (bytes that
are not the method's message, invalid UTF-8 in a string field) is INVALID_ARGUMENT, where grpc.aio alone says UNKNOWN.

Every server is bounded (`make_server`): requests over `MAX_MESSAGE_BYTES` and RPCs past `MAX_CONCURRENT_RPCS` in
flight get RESOURCE_EXHAUSTED from gRPC itself, before any handler runs.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import inspect
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

import grpc
from google.protobuf import duration_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status
from prometheus_client import start_http_server

from radixserve import tracing
from radixserve.transport import PLAINTEXT, TokenInterceptor, TransportSecurity, server_credentials

log = logging.getLogger("radixserve.server")

LAUNCHER_PID_ENV = "RADIXSERVE_LAUNCHER_PID"  # set by radixserve.launch for the services it starts
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_launcher() -> None:
    """If `radixserve.launch` started this process, asks the kernel for SIGTERM when the launcher's thread dies
    (Linux), so a SIGKILLed launcher orphans no service; a launcher already gone ends this process at once."""
    launcher = os.environ.pop(LAUNCHER_PID_ENV, None)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != int(launcher):  # the launcher died before prctl took effect: nobody would signal us
        raise SystemExit("the launcher that started this service is gone")



# glibc's mallopt parameters (<malloc.h>)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
KEEP_HEAP_BYTES = 1 << 30  # free memory the heap keeps at its top before giving any back
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest: allocations above it are their own mappings still


def keep_freed_memory() -> bool:
    """Makes glibc's malloc keep freed memory for reuse instead of returning it to the kernel: allocations up to
    `MMAP_THRESHOLD_BYTES` come from the heap, and the heap keeps up to `KEEP_HEAP_BYTES` free at its top. So a
    service's memory grows to its peak once and then stays. False where the C library has no `mallopt` (musl).
    Call it once start-up is done, so that what start-up frees goes back (a worker that called it before loading the
    model kept the weights' packing buffers: 2,369 against 2,019 MiB resident after the load).

    Why: on VMs whose guest reports freed memory to the host (virtio-balloon free page reporting; these hosts report
    free blocks of 128 KiB and up within milliseconds), touching memory again faults through the host: 2.2-4.1 s a
    GiB against ~0.1 s for memory a process kept. A step's activations and kvcached's block buffers were freed and
    re-faulted that way. The shared-prefix workload through a real stack, 2 runs of 3 rounds each, alternating:
    TTFT mean 295-301 ms against 307-473 in rounds 2-3, round walls 1.71-1.80 s against 1.79-2.70."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    set_ = [mallopt(param, value) for param, value in ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
                                                       (_M_TRIM_THRESHOLD, KEEP_HEAP_BYTES))]
    return all(set_)


def freeze_startup_heap() -> None:
    """Collects once, then moves every object alive (modules, the tokenizer, the model's Python side, ...) to the
    collector's permanent generation (`gc.freeze`), so later full collections walk only what serving created.

    Why: a full collection walks every tracked object and holds the GIL throughout. After start-up a router or worker
    tracks ~230k objects from its imports alone, and while serving, full collections (Python runs one whenever the
    long-lived objects grew by a quarter) took 200-290 ms in routers and workers and 17-25 ms in kvcached, at
    random: inside a restarted L3 hit's routing (router, 270 ms) or its prefetch (kvcached, 17 ms; docs/design.md
    section 9). Frozen objects are still freed by reference counting; only cycles among them are never collected."""
    gc.collect()
    gc.freeze()


# The largest legitimate request is about 1 MiB: the router's default --max-input-chars, 262,144 characters, is at
# most 1 MiB of UTF-8 (4 bytes a character); a prompt of 128k token ids (a long-context model) is at most 640 KiB
# as varints (5 bytes an id; 384 KiB for ids below 2^21); 1,024 chat messages add ~4 KiB of framing, 16 stop
# strings of 512 characters 32 KiB; a worker request (ids + a lease of one slot and generation per page) and
# kvcached's requests (one prompt's ids) are smaller. 4 MiB leaves 4x headroom and is gRPC's own default.
MAX_MESSAGE_BYTES = 4 << 20
# Past this many RPCs in flight on one server gRPC answers RESOURCE_EXHAUSTED itself: a flood costs a bounded number
# of tasks and buffers. A worker or kvcached sees about one RPC per router request in flight, so with the same bound
# everywhere the router, the public server, is the one that refuses first.
MAX_CONCURRENT_RPCS = 1024
# A status message travels as the `grpc-message` trailer, percent-encoded (up to 12 bytes per non-ASCII character),
# and again in `grpc-status-details-bin`; gRPC clients refuse trailers past 8 KiB (some calls) to 16 KiB (all) as
# RESOURCE_EXHAUSTED "metadata size exceeds". 400 characters keep the worst case under 8 KiB.
MAX_DETAILS_CHARS = 400


class ServiceError(Exception):
    """A request that gets a precise gRPC status; the message says what was wrong.

    `retry_after_s` (say, RESOURCE_EXHAUSTED for overload) adds a `google.rpc.RetryInfo` detail with that delay.
    """

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None):
        if retry_after_s is not None and not (math.isfinite(retry_after_s) and retry_after_s >= 0):
            raise ValueError(f"retry_after_s must be a finite number >= 0, not {retry_after_s}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    def rich_status(self) -> grpc.Status:
        """The status with its details in `grpc-status-details-bin`: a RetryInfo when `retry_after_s` is set."""
        status = status_pb2.Status(code=self.code.value[0], message=_one_line(self.message))
        if self.retry_after_s is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(round(self.retry_after_s * 1e9))
            status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        return rpc_status.to_status(status)


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def retry_after_s(error: grpc.RpcError) -> float | None:
    """The RetryInfo delay a failed call's status carries (None without one): what a client waits before retrying,
    and what a router passes on when it forwards a worker's RESOURCE_EXHAUSTED."""
    try:
        status = rpc_status.from_call(error)
    except (AttributeError, ValueError):  # not a call's error, or a trailer that disagrees with the status
        return None
    for detail in status.details if status is not None else ():
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return info.retry_delay.ToNanoseconds() / 1e9
    return None


def _one_line(message: str) -> str:
    """The message as one line of at most MAX_DETAILS_CHARS characters."""
    line = " ".join(message.split())
    return line if len(line) <= MAX_DETAILS_CHARS else line[:MAX_DETAILS_CHARS - 3] + "..."


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts, level, logger, msg, and whatever the call passed in `extra`."""

    _standard = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                 "msg": record.getMessage()}
        entry.update({k: v for k, v in record.__dict__.items() if k not in self._standard})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by handlers, and requests that do not decode, to gRPC statuses (see the module
    docstring). Client-streaming handlers (reflection) pass through untouched."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        decode = _tolerant(handler.request_deserializer)
        if handler.unary_unary:
            return handler._replace(request_deserializer=decode,
                                    unary_unary=_guard_unary(handler.unary_unary, method))
        if handler.unary_stream:
            return handler._replace(request_deserializer=decode,
                                    unary_stream=_guard_stream(handler.unary_stream, method))
        return handler


@dataclass(frozen=True)
class _Undecodable:
    """What `_tolerant` hands the guard instead of a request whose bytes did not parse."""

    error: str


def _tolerant(deserialize):
    """`deserialize`, returning `_Undecodable` instead of raising: grpc.aio would answer UNKNOWN."""
    if deserialize is None:
        return None

    def decode(data: bytes):
        try:
            return deserialize(data)
        except DecodeError as exc:  # a corrupt wire format, invalid UTF-8 in a string field, nesting too deep
            return _Undecodable(str(exc) or "DecodeError")
    return decode


def _check_decoded(request) -> None:
    if isinstance(request, _Undecodable):
        raise invalid(f"the request is not a valid message: {request.error}")


async def _abort_for(exc: BaseException, context: grpc.aio.ServicerContext, method: str) -> None:
    if isinstance(exc, ServiceError):
        if exc.retry_after_s is None:
            await context.abort(exc.code, _one_line(exc.message))
        await context.abort_with_status(exc.rich_status())
    log.exception("unhandled error", extra={"method": method})
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}")


def _guard_unary(fn, method: str):
    async def guarded(request, context):
        try:
            _check_decoded(request)
            return await fn(request, context)
        except Exception as exc:  # CancelledError is a BaseException: it passes through
            if _is_abort(exc):
                raise
            await _abort_for(exc, context, method)
    return guarded


def _guard_stream(fn, method: str):
    if not inspect.isasyncgenfunction(fn):  # a coroutine that calls context.write(), as grpc_health's Watch does
        return _guard_unary(fn, method)

    async def guarded(request, context):
        try:
            _check_decoded(request)
            async for item in fn(request, context):
                yield item
        except Exception as exc:
            if _is_abort(exc):
                raise
            await _abort_for(exc, context, method)
    return guarded


def _is_abort(exc: BaseException) -> bool:
    # context.abort() raises this to unwind the handler; it must pass through untouched.
    return isinstance(exc, grpc.aio.AbortError)


@dataclass(frozen=True)
class ServiceSpec:
    """One servicer to host: `add(servicer, server)` is the generated `add_XServicer_to_server`."""

    servicer: object
    add: Callable[[object, grpc.aio.Server], None]
    full_name: str  # e.g. "radixserve.v1.Router", for health and reflection


def make_server(max_message_bytes: int = MAX_MESSAGE_BYTES, max_concurrent_rpcs: int = MAX_CONCURRENT_RPCS,
                auth_token: str = "") -> grpc.aio.Server:
    """A grpc.aio server with the `StatusInterceptor`, refusing larger messages and more RPCs in flight, and with an
    `auth_token`, calls without it (`TokenInterceptor`)."""
    if max_message_bytes < 1 or max_concurrent_rpcs < 1:
        raise ValueError("max_message_bytes and max_concurrent_rpcs must be positive")
    interceptors = ([TokenInterceptor(auth_token)] if auth_token else []) + [StatusInterceptor()]
    return grpc.aio.server(interceptors=interceptors, maximum_concurrent_rpcs=max_concurrent_rpcs,
                           options=[("grpc.max_receive_message_length", max_message_bytes),
                                    ("grpc.max_send_message_length", max_message_bytes)])


async def serve(name: str, host: str, port: int, metrics_port: int, services: Iterable[ServiceSpec],
                grace_s: float = 10.0, components: Mapping[str, Callable[[], bool]] | None = None,
                max_message_bytes: int = MAX_MESSAGE_BYTES, max_concurrent_rpcs: int = MAX_CONCURRENT_RPCS,
                security: TransportSecurity = PLAINTEXT,
                also_drain: Callable[[], Awaitable[None]] | None = None, traces_endpoint: str = "") -> None:
    """Hosts `services` until SIGTERM/SIGINT, then: health NOT_SERVING, stop with `grace_s`. What start-up left on
    the heap is frozen before the first request (`freeze_startup_heap`).

    Health and reflection are always served. `components` are extra health names (e.g. a cache tier) whose status
    follows their check, polled every `COMPONENT_POLL_S`. `metrics_port` 0 turns the Prometheus endpoint off.
    `max_message_bytes` and `max_concurrent_rpcs` bound the server (`make_server`). `security` (the process's
    config) says TLS or not, client certificates or not, and for an internal server the token it requires; the
    metrics endpoint follows its TLS settings (`radixserve.transport`). `also_drain` stops another listener of the
    process (the router's HTTP API) together with this server, within the same grace. `traces_endpoint` (the
    process's `--otlp-traces-endpoint`) or the standard `OTEL_*` variables turn tracing on (`radixserve.tracing`).
    """
    tracing.setup(name, traces_endpoint)
    services = list(services)
    server = make_server(max_message_bytes, max_concurrent_rpcs,
                         security.auth_token() if security.INTERNAL else "")
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for spec in services:
        spec.add(spec.servicer, server)
    names = [s.full_name for s in services] + [health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    address = f"{host}:{port}"
    credentials = server_credentials(security)
    bound = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if bound == 0:
        raise SystemExit(f"{name}: cannot bind {address}")
    if metrics_port:
        start_http_server(metrics_port, addr=host, certfile=security.tls_cert or None,
                          keyfile=security.tls_key or None, client_cafile=security.tls_ca or None,
                          client_auth_required=security.tls_client_auth)
    freeze_startup_heap()
    await server.start()
    for service_name in ["", *(s.full_name for s in services)]:
        await _set_health(health_servicer, service_name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving", extra={"service": name, "address": address, "metrics_port": metrics_port,
                               "tls": "mutual" if security.tls_client_auth else security.tls,
                               "token": bool(security.INTERNAL and security.auth_token_file),
                               "tracing": tracing.enabled()})
    watch = asyncio.create_task(_watch_components(health_servicer, components or {}))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    watch.cancel()
    started = time.monotonic()
    log.info("draining", extra={"service": name, "grace_s": grace_s})
    for service_name in ["", *(s.full_name for s in services)]:
        await _set_health(health_servicer, service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await asyncio.gather(server.stop(grace_s), *([also_drain()] if also_drain else []))
    log.info("stopped", extra={"service": name, "drain_s": round(time.monotonic() - started, 3)})


COMPONENT_POLL_S = 1.0


async def _watch_components(servicer, components: Mapping[str, Callable[[], bool]]) -> None:
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    while components:
        for component, check in components.items():
            await _set_health(servicer, component, serving if check() else not_serving)
        await asyncio.sleep(COMPONENT_POLL_S)


async def _set_health(servicer, service_name: str, status) -> None:
    result = servicer.set(service_name, status)
    if asyncio.iscoroutine(result):
        await result
