"""The router's request path (`Router`) and the gRPC glue of the public `radixserve.v1.Router` service over it;
validation, tokenization and routing live beside it, the HTTP API in `router.http_server`."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection

import grpc

from radixserve.blocks.keys import BlockHash, block_hashes, namespace_key
from radixserve.server import ServiceError, retry_after_s
from radixserve.transport import peer_identity
from radixserve.v1 import router_pb2, router_pb2_grpc, worker_pb2
from router import metrics
from router.admission import Admission, Overloaded, Ticket
from router.prefix import PrefixMatcher, Reuse
from router.routing import NoWorker, WorkerHandle, WorkerPool
from router.tenants import OPEN, Tenants
from router.tokenizer import TokenizerLanes
from router.validation import Limits, prompt_ids, resolve_sampling

log = logging.getLogger("router.service")

# Worker failures the client sees as they are; anything else is the worker being unreachable.
_PASSED_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED,
                   grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL}
RETRIES = 1  # a request whose worker is lost before its first token runs once more, elsewhere
OVERLOAD_RETRY_S = 1.0  # the retry delay an overloaded router suggests: about one long prefill here


class Router:
    """The router's one request path, whatever the transport: the gRPC servicer and the HTTP API both call it.

    `generate` tokenizes and validates (INVALID_ARGUMENT), admits (RESOURCE_EXHAUSTED with a retry delay), matches
    the cached prefix, routes, runs the request on a worker (once more elsewhere if that worker is lost before its
    first token; UNAVAILABLE otherwise) and accumulates its outputs. Failures are `ServiceError`s with a gRPC status;
    a transport maps them to its own. Closing or cancelling the iterator cancels the worker's request, which frees
    its pages.
    """

    def __init__(self, pool: WorkerPool, tokenizers: TokenizerLanes, limits: Limits, matcher: PrefixMatcher | None,
                 admission: Admission, tenants: Tenants = OPEN):
        """`matcher` None: radix cache disabled; workers neither reuse nor cache pages. `tenants` authenticates the
        callers (`identify`, which the transports call) and keys their cache namespaces."""
        self._pool = pool
        self._admission = admission
        self._matcher = matcher
        self._tokenizers = tokenizers
        self._limits = limits
        self._tenants = tenants

    @property
    def model(self) -> router_pb2.ModelInfo:
        return self._pool.model

    @property
    def serving(self) -> bool:
        """Some worker can take a request."""
        return self._pool.serving

    def identify(self, authorization: str | None, peer: str | None) -> str | None:
        """The caller's tenant (`Tenants.identify`): every transport asks before it serves a call."""
        return self._tenants.identify(authorization, peer)

    async def generate(self, request: router_pb2.GenerateRequest, time_remaining: Callable[[], float | None],
                       tenant: str | None = None) -> AsyncIterator[router_pb2.GenerateResponse]:
        """The responses to `request`: deltas when `request.stream`, else exactly one message; the last carries
        `finish_reason`, usage and timings. `time_remaining()` is the client's remaining time in seconds (None: no
        deadline); past it the request fails with DEADLINE_EXCEEDED. `tenant` (from `identify`) owns the cache
        namespace with the request's salt inside it."""
        started = time.monotonic()
        ids = await self._prompt_ids(request)
        sampling = resolve_sampling(request.sampling, len(ids), self._limits)
        try:
            ticket = self._admission.admit(len(ids))
        except Overloaded as e:
            metrics.requests.labels(outcome="overloaded").inc()
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"router overloaded: {e}",
                               retry_after_s=OVERLOAD_RETRY_S) from None
        metrics.prompt_tokens.inc(len(ids))
        cache_salt = Tenants.cache_salt(tenant, request.cache_salt)
        forward = worker_pb2.WorkerGenerateRequest(
            request_id=request.request_id or uuid.uuid4().hex, prompt_ids=ids, sampling=sampling,
            cache_salt=cache_salt, disable_cache=self._matcher is None)
        keys = self._block_keys(ids, cache_salt)
        lost: list[WorkerHandle] = []
        try:
            while True:
                try:
                    async for response in self._attempt(forward, keys, lost, started, ticket, request.stream,
                                                        time_remaining):
                        yield response
                    return
                except _WorkerLost as e:
                    lost.append(e.worker)
                    if e.answered or len(lost) > RETRIES:
                        raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"model worker {e.worker.address} is "
                                                                        "unavailable") from None
                    log.warning("worker lost before the first token; retrying on another",
                                extra={"worker": e.worker.address, "request_id": forward.request_id})
        finally:
            ticket.done()

    async def _attempt(self, forward: worker_pb2.WorkerGenerateRequest, keys: list[BlockHash],
                       lost: list[WorkerHandle], started: float, ticket: Ticket, stream: bool,
                       time_remaining: Callable[[], float | None]) -> AsyncIterator[router_pb2.GenerateResponse]:
        """One try on a healthy worker not in `lost`; raises `_WorkerLost` if that worker turns out unreachable."""
        try:
            with self._pool.pick(keys, exclude=lost) as worker:
                async for response in self._run_on(worker, forward, started, ticket, stream, time_remaining):
                    yield response
        except NoWorker as e:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, str(e)) from None

    async def _run_on(self, worker: WorkerHandle, forward: worker_pb2.WorkerGenerateRequest, started: float,
                      ticket: Ticket, stream: bool, time_remaining: Callable[[], float | None]
                      ) -> AsyncIterator[router_pb2.GenerateResponse]:
        # Matched in the chosen worker's namespace: the worker copies the lease, and verifies it against its own.
        reuse = (await self._matcher.reuse(worker.info.model.fingerprint, list(forward.prompt_ids),
                                           forward.cache_salt, time_remaining())
                 if self._matcher else Reuse(None))
        attempt = worker_pb2.WorkerGenerateRequest()
        attempt.CopyFrom(forward)
        if reuse.lease is not None:
            attempt.l2_lease.CopyFrom(reuse.lease)
        run = _Run(forward.request_id, len(forward.prompt_ids), started, reuse, worker.info.model.page_size, ticket)
        call = worker.stub.Generate(attempt, timeout=time_remaining())
        try:
            async for out in _worker_outputs(call, worker, self._pool):
                response = run.add(out)
                if stream or out.finish_reason:
                    yield run.flush(response)
        except _WorkerLost as e:
            e.answered = run.outputs > 0
            raise
        finally:
            call.cancel()
            run.close()
            if run.outputs == 0 and reuse.lease is not None:  # the worker may never have seen the lease
                self._matcher.release_soon(reuse.lease.lease_id)
        metrics.requests.labels(outcome=run.finish_reason or "abort").inc()

    def _block_keys(self, ids: list[int], cache_salt: str) -> list[BlockHash]:
        """The prompt's block keys, for cache-aware routing; none when the cache is off."""
        if self._matcher is None:
            return []
        return block_hashes(namespace_key(self._pool.routing_fingerprint, cache_salt), ids, self._pool.model.page_size)

    async def tokenize(self, request: router_pb2.TokenizeRequest) -> list[int]:
        """The token ids `generate` would compute for the same text or messages."""
        return await self._prompt_ids(request)

    async def token_strings(self, ids: Collection[int]) -> dict[int, tuple[str, bytes]]:
        """Each token's text and bytes (`PromptTokenizer.token_strings`), to render logprobs; on the short
        tokenizing thread (a tokenizer is not safe for concurrent calls), which a handful of ids holds briefly."""
        if not ids:
            return {}
        ids = list(ids)
        executor, tokenizer = self._tokenizers.lane(0)
        return dict(zip(ids, await asyncio.get_running_loop().run_in_executor(executor, tokenizer.token_strings, ids),
                        strict=True))

    async def _prompt_ids(self, request: router_pb2.GenerateRequest | router_pb2.TokenizeRequest) -> list[int]:
        """`prompt_ids` on the tokenizing thread of the request's size (`TokenizerLanes`: a long prompt never stalls
        the event loop or a short one); its INVALID_ARGUMENT errors propagate as they are."""
        executor, tokenizer = self._tokenizers.lane(request.ByteSize())
        return await asyncio.get_running_loop().run_in_executor(executor, prompt_ids, request, tokenizer,
                                                                self._limits)


class RouterServicer(router_pb2_grpc.RouterServicer):
    """The public `radixserve.v1.Router` service over `Router`; the gRPC deadline is the request's."""

    def __init__(self, router: Router):
        self._router = router

    async def Generate(self, request: router_pb2.GenerateRequest, context
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        tenant = self._identify(context)
        async for response in self._router.generate(request, context.time_remaining, tenant):
            yield response

    async def Tokenize(self, request: router_pb2.TokenizeRequest, context) -> router_pb2.TokenizeResponse:
        self._identify(context)
        return router_pb2.TokenizeResponse(token_ids=await self._router.tokenize(request))

    async def ListModels(self, request, context) -> router_pb2.ListModelsResponse:
        self._identify(context)
        return router_pb2.ListModelsResponse(models=[self._router.model])

    def _identify(self, context) -> str | None:
        """The caller's tenant from its `authorization` metadata and mTLS certificate (UNAUTHENTICATED if one the
        router requires is missing)."""
        metadata = dict(context.invocation_metadata() or ())
        return self._router.identify(metadata.get("authorization"), peer_identity(context))


class _WorkerLost(Exception):
    def __init__(self, worker: WorkerHandle):
        super().__init__(worker.address)
        self.worker = worker
        self.answered = False  # it had sent outputs: too late to retry elsewhere


async def _worker_outputs(call, worker: WorkerHandle, pool: WorkerPool
                          ) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
    """The worker's outputs; its own statuses pass through as they are, and anything else means the worker is
    unreachable: it leaves the rotation and `_WorkerLost` is raised."""
    try:
        async for out in call:
            yield out
    except grpc.aio.AioRpcError as e:
        if e.code() in _PASSED_THROUGH:  # with the worker's retry delay, when it gave one
            raise ServiceError(e.code(), e.details(), retry_after_s=retry_after_s(e)) from None
        log.warning("worker failed", extra={"worker": worker.address, "code": e.code().name, "details": e.details()})
        pool.mark_failed(worker)
        raise _WorkerLost(worker) from None


class _Run:
    """Accumulates one request's worker outputs into the client's responses (deltas or one final message).

    The request counts as waiting (`radixserve_waiting_queue_size`) from admission to its first token or `close()`.
    """

    def __init__(self, request_id: str, prompt_tokens: int, started: float, reuse: Reuse, page_size: int,
                 ticket: Ticket):
        self.request_id = request_id
        self.ticket = ticket
        self.reuse = reuse
        self.page_size = page_size
        self.prompt_tokens = prompt_tokens
        self.started = started
        self.first_token_at: float | None = None
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[router_pb2.TokenLogprobs] = []  # what the worker sent, when asked: passed on as is
        self.prompt_logprobs: list[router_pb2.TokenLogprobs] = []
        self.completion_tokens = 0
        self.outputs = 0  # messages from the worker
        self.finish_reason = ""
        metrics.waiting_queue_size.inc()

    def add(self, out: worker_pb2.WorkerGenerateResponse) -> worker_pb2.WorkerGenerateResponse:
        self.outputs += 1
        if out.token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
            metrics.time_to_first_token.observe(self.first_token_at - self.started)
            metrics.waiting_queue_size.dec()
            self.ticket.done()  # running now: it no longer counts against the router's admission bounds
        self.text.append(out.text)
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        self.prompt_logprobs.extend(out.prompt_logprobs)
        self.completion_tokens += len(out.token_ids)
        self.finish_reason = out.finish_reason
        return out

    def close(self) -> None:
        if self.first_token_at is None:
            metrics.waiting_queue_size.dec()

    def flush(self, last: worker_pb2.WorkerGenerateResponse) -> router_pb2.GenerateResponse:
        """Everything gathered since the previous flush; the final one carries usage and timings."""
        response = router_pb2.GenerateResponse(request_id=self.request_id, text="".join(self.text),
                                               token_ids=self.token_ids, finish_reason=last.finish_reason,
                                               logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs)
        self.text, self.token_ids, self.logprobs, self.prompt_logprobs = [], [], [], []
        if last.finish_reason:
            self._finish(response, last)
        return response

    def _finish(self, response: router_pb2.GenerateResponse, last: worker_pb2.WorkerGenerateResponse) -> None:
        now = time.monotonic()
        l1, copied = last.cached_tokens_l1, last.cached_tokens_l2
        l3 = self._from_l3(l1, copied)
        response.usage.CopyFrom(router_pb2.Usage(
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens, cached_tokens=l1 + copied,
            cached_tokens_l1=l1, cached_tokens_l2=copied - l3, cached_tokens_l3=l3))
        ttft = (self.first_token_at or now) - self.started
        response.timings.CopyFrom(router_pb2.Timings(queue_ms=last.queue_ms, prefill_ms=last.prefill_ms,
                                                     prefetch_wait_ms=self.reuse.prefetch_wait_s * 1e3,
                                                     ttft_ms=ttft * 1e3, e2e_ms=(now - self.started) * 1e3))
        metrics.generation_tokens.inc(self.completion_tokens)
        metrics.e2e_latency.observe(now - self.started)
        for tier, n in (("l1", l1), ("l2", copied - l3), ("l3", l3)):
            metrics.cached_tokens.labels(tier=tier).inc(n)

    def _from_l3(self, l1: int, copied: int) -> int:
        """Tokens the worker copied from L2 that were loaded from L3 for this request.

        The worker copied tokens [l1, l1 + copied) from L2; the pages loaded from L3 cover `reuse.l3_pages`.
        """
        loaded = self.reuse.l3_pages
        overlap = min(l1 + copied, loaded.stop * self.page_size) - max(l1, loaded.start * self.page_size)
        return max(0, overlap)
