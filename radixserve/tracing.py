"""OpenTelemetry tracing for the three services: on only where an OTLP endpoint is configured, free otherwise.

Contract:
- `setup(service, flag)` runs once at process start (`radixserve.server.serve`). The endpoint is the flag
  (`--otlp-traces-endpoint`), else the standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, else
  `OTEL_EXPORTER_OTLP_ENDPOINT`. With none, or `OTEL_SDK_DISABLED=true`, or `OTEL_TRACES_EXPORTER=none`, no tracer
  provider is installed: `enabled()` is False and every helper here returns at once (no span objects, no context
  switches, no metadata). Otherwise an SDK provider with a batching OTLP/gRPC exporter is installed; the SDK reads
  the other `OTEL_*` variables itself (sampler, batch delay and sizes, headers, resource attributes, service name).
- Context crosses processes as W3C `traceparent`/`tracestate` gRPC metadata: `outgoing()` is the metadata of a
  call made under the current span, `incoming(context)` the parent context a handler's caller sent (a client's own
  trace context is honoured the same way at the router).
- `span(...)` is the current-span context manager of the SDK, or a shared null context yielding the API's
  non-recording `INVALID_SPAN` (whose setters and `end` do nothing) when off; `start(...)` a span the caller ends,
  not made current (one that outlives a `with` block); `record(...)` a finished span with explicit start and end
  times, for work timed elsewhere (the worker's engine thread) and reported after the fact.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Mapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind

log = logging.getLogger("radixserve.tracing")

TRACER = "radixserve"
_OFF = contextlib.nullcontext(INVALID_SPAN)  # re-entrant: yields the no-op span, holds no state


def traces_endpoint(flag: str, environ: Mapping[str, str]) -> str:
    """Where spans go (see the module docstring); empty: tracing off. A bare HOST:PORT means plaintext gRPC."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ""
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return ""
    endpoint = (flag or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
                or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")).strip()
    return endpoint if not endpoint or "://" in endpoint else f"http://{endpoint}"


def setup(service: str, flag: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Installs the exporting provider when an endpoint is configured; whether tracing is on. Call once."""
    endpoint = traces_endpoint(flag, environ)
    if not endpoint:
        return False
    # Imported only here: a process without tracing never loads the SDK or the exporter.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME, when set, names the service (Resource.create reads it); ours is the default.
    resource = Resource.create({} if environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: f"radixserve-{service}"})
    provider = TracerProvider(resource=resource)  # flushes its batch at interpreter exit
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint,
                                                                    insecure=endpoint.startswith("http://"))))
    trace.set_tracer_provider(provider)
    log.info("tracing on", extra={"service": service, "otlp_endpoint": endpoint})
    return True


def enabled() -> bool:
    """A provider is installed (the cheap check every helper makes first)."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def span(name: str, parent: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
         attributes: Mapping[str, object] | None = None) -> contextlib.AbstractContextManager[Span]:
    """A span made current for the `with` block, child of `parent` (None: of the current span); exceptions are
    recorded on it."""
    if not enabled():
        return _OFF
    return trace.get_tracer(TRACER).start_as_current_span(name, context=parent, kind=kind, attributes=attributes)


def joined(name: str, context) -> contextlib.AbstractContextManager[Span]:
    """A SERVER span in the trace a gRPC caller sent (`context` is the handler's ServicerContext), made current;
    the null context when tracing is off or the caller sent none: an internal RPC is worth a span only as part of a
    request's trace (a heartbeat is not)."""
    parent = incoming(context)
    if parent is None or not trace.get_current_span(parent).get_span_context().is_valid:
        return _OFF
    return trace.get_tracer(TRACER).start_as_current_span(name, context=parent, kind=SpanKind.SERVER)


def start(name: str, kind: SpanKind = SpanKind.INTERNAL, parent: Context | None = None,
          attributes: Mapping[str, object] | None = None) -> Span:
    """A span that is not made current; the caller ends it (`INVALID_SPAN`, whose `end` does nothing, when off)."""
    if not enabled():
        return INVALID_SPAN
    return trace.get_tracer(TRACER).start_span(name, context=parent, kind=kind, attributes=attributes)


def record(name: str, parent: Span, start_ns: int, end_ns: int, attributes: Mapping[str, object] | None = None
           ) -> None:
    """A finished child of `parent` over [start_ns, end_ns] (Unix nanoseconds). Nothing when off."""
    if parent.is_recording():
        trace.get_tracer(TRACER).start_span(name, context=trace.set_span_in_context(parent), start_time=start_ns,
                                            attributes=attributes).end(end_time=max(start_ns, end_ns))


def annotate(attributes: Mapping[str, object]) -> None:
    """Sets `attributes` on the current span (nothing when off or outside a span)."""
    trace.get_current_span().set_attributes(attributes)


def outgoing(span: Span | None = None) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying `span` (None: the current span) to a callee, as W3C trace context; None when off."""
    if not enabled():
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=None if span is None else trace.set_span_in_context(span))
    return tuple(carrier.items())


def extract(metadata: Iterable[tuple[str, str]] | None) -> Context | None:
    """The trace context in `metadata` (an `outgoing` result, a call's invocation metadata); None when off."""
    if not enabled():
        return None
    return propagate.extract(dict(metadata or ()))


def incoming(context) -> Context | None:
    """The trace context a gRPC caller sent (`context` is the handler's ServicerContext); None when off."""
    if not enabled():
        return None
    return extract(context.invocation_metadata())


def from_headers(headers: Mapping[str, str]) -> Context | None:
    """The trace context in HTTP request headers; None when off."""
    return propagate.extract(headers) if enabled() else None
