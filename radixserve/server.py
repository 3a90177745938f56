"""The gRPC wiring every radixserve process shares: logging, status mapping, health, reflection, metrics, shutdown.

A servicer raises `ServiceError(code, message)` for anything the client did wrong or that cannot be served now; the
`StatusInterceptor` turns it into that status and message. Any other exception is logged with its traceback and the
client gets INTERNAL with a one-line message, never the traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

log = logging.getLogger("radixserve.server")


class ServiceError(Exception):
    """A request that gets a precise gRPC status; the message says what was wrong."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


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
    """Maps exceptions raised by handlers to gRPC statuses (see the module docstring)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary:
            return handler._replace(unary_unary=_guard_unary(handler.unary_unary, method))
        if handler.unary_stream:
            return handler._replace(unary_stream=_guard_stream(handler.unary_stream, method))
        return handler


async def _abort_for(exc: BaseException, context: grpc.aio.ServicerContext, method: str) -> None:
    if isinstance(exc, ServiceError):
        await context.abort(exc.code, exc.message)
    log.exception("unhandled error", extra={"method": method})
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}")


def _guard_unary(fn, method: str):
    async def guarded(request, context):
        try:
            return await fn(request, context)
        except Exception as exc:  # CancelledError is a BaseException: it passes through
            if _is_abort(exc):
                raise
            await _abort_for(exc, context, method)
    return guarded


def _guard_stream(fn, method: str):
    async def guarded(request, context):
        try:
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


async def serve(name: str, host: str, port: int, metrics_port: int, services: Iterable[ServiceSpec],
                grace_s: float = 10.0, components: Mapping[str, Callable[[], bool]] | None = None) -> None:
    """Hosts `services` until SIGTERM/SIGINT, then: health NOT_SERVING, stop with `grace_s`.

    Health and reflection are always served. `components` are extra health names (e.g. a cache tier) whose status
    follows their check, polled every `COMPONENT_POLL_S`. `metrics_port` 0 turns the Prometheus endpoint off.
    """
    services = list(services)
    server = grpc.aio.server(interceptors=[StatusInterceptor()],
                             options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)])
    health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for spec in services:
        spec.add(spec.servicer, server)
    names = [s.full_name for s in services] + [health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    address = f"{host}:{port}"
    if server.add_insecure_port(address) == 0:
        raise SystemExit(f"{name}: cannot bind {address}")
    if metrics_port:
        start_http_server(metrics_port, addr=host)
    await server.start()
    for service_name in ["", *(s.full_name for s in services)]:
        await _set_health(health_servicer, service_name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving", extra={"service": name, "address": address, "metrics_port": metrics_port})
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
    await server.stop(grace_s)
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
