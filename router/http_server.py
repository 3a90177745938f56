"""The router's HTTP API: OpenAI's `/v1/chat/completions`, `/v1/completions` and `/v1/models`, SGLang's `/generate`,
`/health` and `/metrics`, in the router's own event loop beside its grpc.aio server.

A generation runs the router's one request path (`Router.generate`, as gRPC Generate does); this module only moves
bytes: it bounds and decodes the body, lets `router.http_protocol` translate it and render the responses, and maps
failures to OpenAI-shaped error bodies (`HttpError`, from the router's statuses by `http_error`): 400 bad input, 404
unknown model or path, 413 body over `MAX_BODY_BYTES`, 429 overload with `Retry-After`, 503 no worker, 504 past the
deadline (the `X-Request-Timeout` header, seconds; none by default, as in gRPC), 500 with one line for a bug, never
a traceback. A request's status is decided before its first byte: a streamed request answers 200 with its first
token, and a failure after that is the stream's last event (`{"error": ...}`, then `[DONE]`).

A client that disconnects cancels its handler (aiohttp's handler cancellation), which closes `Router.generate`: the
worker's request is cancelled and its pages freed, as when a gRPC client cancels.

NOTE: aiohttp rather than an ASGI stack (uvicorn with starlette or FastAPI). `AppRunner` + `TCPSite` is aiohttp's
documented way to serve inside an event loop someone else runs, and leaves signals alone; uvicorn's `Server.serve()`
installs its own SIGINT/SIGTERM handlers (it is built to own the process), which here belong to
`radixserve.server.serve` and its drain. aiohttp also bounds the body as it reads (`client_max_size`) and cancels a
handler whose client went away, both of which an ASGI app would hand-roll.
"""

from __future__ import annotations

import json
import logging
import math
import ssl
import time
from collections.abc import Callable
from contextlib import aclosing

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from radixserve import tracing
from radixserve.server import MAX_MESSAGE_BYTES, ServiceError
from radixserve.v1 import router_pb2
from router import http_protocol as protocol
from router.http_protocol import HttpError
from router.service import Router

log = logging.getLogger("router.http")

# The gRPC bound, and enough: JSON is larger than protobuf, but a prompt at --max-input-chars, even escaped as
# \uXXXX (6 bytes a character, 12 for one outside the BMP), or a context of token ids as decimals, stays under it.
MAX_BODY_BYTES = MAX_MESSAGE_BYTES
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"


class HttpApi:
    """The routes over one `Router`; `application()` is the aiohttp app."""

    def __init__(self, router: Router):
        self._router = router
        self._started = int(time.time())

    def application(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors])
        app.add_routes([web.post("/v1/chat/completions", self.chat_completions),
                        web.post("/v1/completions", self.completions),
                        web.post("/generate", self.generate),
                        web.get("/v1/models", self.models),
                        web.get("/health", self.health),
                        web.get("/metrics", self.metrics)])
        return app

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, protocol.parse_chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, protocol.parse_completion)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, protocol.parse_sglang)

    async def models(self, request: web.Request) -> web.Response:
        _identify(self._router, request)
        model = self._router.model
        return web.json_response({"object": "list", "data": [{
            "id": model.name, "object": "model", "created": self._started, "owned_by": "radixserve",
            "root": model.name, "max_model_len": model.max_context}]}, dumps=_dumps)

    async def health(self, request: web.Request) -> web.Response:
        """200 while some worker can serve (the router's gRPC health), else 503."""
        if not self._router.serving:
            raise HttpError(503, "no healthy model worker", code="service_unavailable")
        return web.json_response({"status": "serving"}, dumps=_dumps)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _generate(self, request: web.Request, parse: Callable[..., protocol.Call]) -> web.StreamResponse:
        tenant = _identify(self._router, request)
        call = parse(protocol.parse_json(await _body(request)), self._router.model.name, int(time.time()))
        if not call.request.request_id:
            call.request.request_id = protocol.parse_request_id(request.headers.get("X-Request-Id"))
        async with aclosing(self._router.generate(call.request, _time_remaining(request), tenant,
                                                  tracing.from_headers(request.headers))) as responses:
            try:
                first = await anext(responses)
                whole = [first, *[response async for response in responses]] if not call.answer.stream else []
            except ServiceError as e:  # before the first byte: the answer is the error, with its status
                raise protocol.http_error(e, call.names) from None
            if whole:
                return web.json_response(call.answer.whole(whole, await self._strings(*whole)), dumps=_dumps)
            stream = web.StreamResponse(headers=SSE_HEADERS)
            await stream.prepare(request)
            try:
                await _send(stream, call.answer.events(first, await self._strings(first)))
                async for response in responses:
                    await _send(stream, call.answer.events(response, await self._strings(response)))
            except ConnectionError:
                raise  # the client is gone: nothing to tell it
            except Exception as e:  # noqa: BLE001 -- too late for a status: the last event says what happened
                await _send(stream, [_as_http_error(e, request, call.names).body()])
            await stream.write(DONE)
            return stream

    async def _strings(self, *responses: router_pb2.GenerateResponse) -> dict[int, tuple[str, bytes]]:
        """The text and bytes of the tokens the responses' logprobs name (none without logprobs)."""
        return await self._router.token_strings(protocol.logprob_token_ids(*responses))


def _identify(router: Router, request: web.Request) -> str | None:
    """The caller's tenant from its `Authorization` header and verified client certificate (its first
    subjectAltName, as gRPC names a peer); 401 when one the router requires is missing."""
    certificate = request.transport.get_extra_info("peercert") if request.transport else None
    names = (certificate or {}).get("subjectAltName", ())
    return router.identify(request.headers.get("Authorization"), names[0][1] if names else None)


async def _body(request: web.Request) -> bytes:
    """The whole body, refused (413) from its Content-Length before any of it is read, or once reading passes the
    bound (a chunked body has no length)."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise _too_large()
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large() from None


def _too_large() -> HttpError:
    return HttpError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")


def _time_remaining(request: web.Request) -> Callable[[], float | None]:
    timeout_s = protocol.parse_timeout(request.headers.get("X-Request-Timeout"))
    if timeout_s is None:
        return lambda: None
    deadline = time.monotonic() + timeout_s
    return lambda: deadline - time.monotonic()


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


async def _send(stream: web.StreamResponse, events: list[dict]) -> None:
    for event in events:
        await stream.write(b"data: " + _dumps(event).encode() + b"\n\n")


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure as an OpenAI-shaped error body with its status (see the module docstring)."""
    try:
        return await handler(request)
    except ConnectionError:
        raise  # the client is gone; aiohttp drops the connection quietly
    except Exception as e:  # noqa: BLE001 -- any failure is an answer, never a traceback; bugs are logged
        error = _as_http_error(e, request)
        headers = {} if error.retry_after_s is None else {"Retry-After": str(max(1, math.ceil(error.retry_after_s)))}
        return web.json_response(error.body(), status=error.status, headers=headers, dumps=_dumps)


def _as_http_error(error: Exception, request: web.Request, names: protocol.FieldNames = protocol.NO_NAMES
                   ) -> HttpError:
    """`error` as an HTTP error; anything unexpected is logged with its traceback and is a one-line 500."""
    if isinstance(error, HttpError):
        return error
    if isinstance(error, ServiceError):
        return protocol.http_error(error, names)
    if isinstance(error, web.HTTPException):  # aiohttp's own: no such path (404), method (405)
        return HttpError(error.status, f"{error.reason}: {request.method} {request.path}")
    log.exception("unhandled error", extra={"path": request.path})
    return HttpError(500, f"internal error in {request.method} {request.path}: {type(error).__name__}")


async def start_http(router: Router, host: str, port: int, grace_s: float, ssl_context: ssl.SSLContext | None = None
                     ) -> web.AppRunner:
    """Serves the HTTP API on `host:port` in the running loop until `runner.cleanup()`, which stops accepting and
    gives running requests `grace_s`; HTTPS with `ssl_context`; SystemExit when the port cannot be bound."""
    runner = web.AppRunner(HttpApi(router).application(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=grace_s)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    except OSError as e:
        await runner.cleanup()
        raise SystemExit(f"router: cannot bind HTTP {host}:{port}: {e.strerror}") from None
    log.info("serving HTTP", extra={"address": f"{host}:{port}"})
    return runner
