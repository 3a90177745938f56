"""The router's request path (`Router`) and the gRPC glue of the public `radixserve.v1.Router` service over it;
validation, tokenization and routing live beside it, the HTTP API in `router.http_server`."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection

import grpc
from opentelemetry.context import Context

from radixserve import tracing
from radixserve.blocks.keys import BlockHash, block_hashes, namespace_key
from radixserve.server import ServiceError, retry_after_s
from radixserve.transport import peer_identity
from radixserve.v1 import router_pb2, router_pb2_grpc, worker_pb2
from router import metrics, stats
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
STATS_TIMEOUT_S = 1.0  # a worker's GetInfo answers in milliseconds; one that does not is left out of Stats


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
                       tenant: str | None = None, parent: Context | None = None
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """The responses to `request`: deltas when `request.stream`, else exactly one message; the last carries
        `finish_reason`, usage and timings. `time_remaining()` is the client's remaining time in seconds (None: no
        deadline); past it the request fails with DEADLINE_EXCEEDED. `tenant` (from `identify`) owns the cache
        namespace with the request's salt inside it. With tracing on, the request is one span, child of the client's
        trace context `parent` (None: a new trace), with its tokenize, match, prefetch wait and worker call below."""
        with tracing.span("router.generate", parent, tracing.SpanKind.SERVER) as span:
            async for response in self._generate(request, time_remaining, tenant):
                if span.is_recording() and response.HasField("usage"):
                    span.set_attributes(_usage_attributes(response))
                yield response

    async def _generate(self, request: router_pb2.GenerateRequest, time_remaining: Callable[[], float | None],
                        tenant: str | None) -> AsyncIterator[router_pb2.GenerateResponse]:
        started = time.monotonic()
        series = metrics.of(self.model.name)
        with tracing.span("router.tokenize"):
            ids = await self._prompt_ids(request)
        sampling = resolve_sampling(request.sampling, len(ids), self._limits)
        try:
            ticket = self._admission.admit(len(ids))
        except Overloaded as e:
            series.requests("overloaded").inc()
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"router overloaded: {e}",
                               retry_after_s=OVERLOAD_RETRY_S) from None
        series.prompt_tokens.inc(len(ids))
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
        run = _Run(forward.request_id, len(forward.prompt_ids), forward.sampling.n, started, reuse,
                   worker.info.model.page_size, ticket, metrics.of(self.model.name),
                   leased_pages=0 if reuse.lease is None else len(reuse.lease.slots),
                   reusable_tokens=(forward.sampling.prompt_logprobs_start if forward.sampling.prompt_logprobs
                                    else len(forward.prompt_ids)))
        span = tracing.start("router.worker_generate", tracing.SpanKind.CLIENT,
                             attributes={"radixserve.worker": worker.address})
        call = worker.stub.Generate(attempt, timeout=time_remaining(), metadata=tracing.outgoing(span))
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
            span.end()
            if run.outputs == 0 and reuse.lease is not None:  # the worker may never have seen the lease
                self._matcher.release_soon(reuse.lease.lease_id)
        run.series.requests(run.finish_reason or "abort").inc()

    def _block_keys(self, ids: list[int], cache_salt: str) -> list[BlockHash]:
        """The prompt's block keys, for cache-aware routing; none when the cache is off."""
        if self._matcher is None:
            return []
        return block_hashes(namespace_key(self._pool.routing_fingerprint, cache_salt), ids, self._pool.model.page_size)

    async def stats(self) -> router_pb2.StatsResponse:
        """The rates since start (`router.stats`), with the admission counts of every healthy worker that answers
        its `GetInfo` within `STATS_TIMEOUT_S` (`workers_answered`)."""
        infos = await asyncio.gather(*(w.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=STATS_TIMEOUT_S)
                                       for w in self._pool.workers if w.healthy), return_exceptions=True)
        answered = [info for info in infos if isinstance(info, worker_pb2.WorkerInfo)]
        return router_pb2.StatsResponse(models=[stats.model_stats(self.model.name, answered)])

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
        the event loop or a short one), or here when the request brings token ids: those are only checked, which
        takes less than the two thread switches (the hop took 0.3-3.6 ms of a shared-prefix hit's path in traces);
        its INVALID_ARGUMENT errors propagate as they are."""
        executor, tokenizer = self._tokenizers.lane(request.ByteSize())
        if getattr(request, "token_ids", None):
            return prompt_ids(request, tokenizer, self._limits)
        return await asyncio.get_running_loop().run_in_executor(executor, prompt_ids, request, tokenizer,
                                                                self._limits)


class RouterServicer(router_pb2_grpc.RouterServicer):
    """The public `radixserve.v1.Router` service over `Router`; the gRPC deadline is the request's."""

    def __init__(self, router: Router):
        self._router = router

    async def Generate(self, request: router_pb2.GenerateRequest, context
                       ) -> AsyncIterator[router_pb2.GenerateResponse]:
        tenant = self._identify(context)
        async for response in self._router.generate(request, context.time_remaining, tenant,
                                                    tracing.incoming(context)):
            yield response

    async def Stats(self, request, context) -> router_pb2.StatsResponse:
        self._identify(context)
        return await self._router.stats()

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


def _usage_attributes(response: router_pb2.GenerateResponse) -> dict[str, object]:
    usage = response.usage
    return {"radixserve.request_id": response.request_id, "radixserve.prompt_tokens": usage.prompt_tokens,
            "radixserve.completion_tokens": usage.completion_tokens,
            "radixserve.cached_tokens.l1": usage.cached_tokens_l1, "radixserve.cached_tokens.l2": usage.cached_tokens_l2,
            "radixserve.cached_tokens.l3": usage.cached_tokens_l3, "radixserve.finish_reason": response.finish_reason}


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


class _Gathered:
    """One sample's outputs since its previous flush; logprobs are passed on as the worker sent them."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[router_pb2.TokenLogprobs] = []
        self.prompt_logprobs: list[router_pb2.TokenLogprobs] = []


class _Run:
    """Accumulates one request's worker outputs into the client's responses: per sample, deltas or one final
    message; the request's last message carries usage and timings.

    The request counts as waiting (`radixserve_waiting_queue_size`) from admission to its first token or `close()`.
    """

    def __init__(self, request_id: str, prompt_tokens: int, samples: int, started: float, reuse: Reuse,
                 page_size: int, ticket: Ticket, series: metrics.ModelMetrics, leased_pages: int,
                 reusable_tokens: int):
        """`leased_pages`: the L2 pages of the worker's lease; `reusable_tokens`: the prompt as far as the worker may
        reuse cached pages for it (one token short of it: `model_worker.scheduler.Sequence.reusable`)."""
        self.request_id = request_id
        self.series = series
        self.leased_pages = leased_pages
        self.usable_pages = (reusable_tokens - 1) // page_size
        self.ticket = ticket
        self.reuse = reuse
        self.page_size = page_size
        self.prompt_tokens = prompt_tokens
        self.started = started
        self.first_token_at: float | None = None
        self.gathered = [_Gathered() for _ in range(samples)]
        self.running = samples  # samples not yet finished
        self.completion_tokens = 0
        self.outputs = 0  # messages from the worker
        self.finish_reason = ""
        series.waiting_queue_size.inc()

    def add(self, out: worker_pb2.WorkerGenerateResponse) -> worker_pb2.WorkerGenerateResponse:
        """Raises ServiceError(INTERNAL) for a sample index the request does not have."""
        if out.index >= len(self.gathered):
            raise ServiceError(grpc.StatusCode.INTERNAL, f"the worker answered for sample {out.index} of a request "
                                                         f"of {len(self.gathered)}")
        self.outputs += 1
        if out.token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
            self.series.time_to_first_token.observe(self.first_token_at - self.started)
            self.series.waiting_queue_size.dec()
            self.ticket.done()  # running now: it no longer counts against the router's admission bounds
        gathered = self.gathered[out.index]
        gathered.text.append(out.text)
        gathered.token_ids.extend(out.token_ids)
        gathered.logprobs.extend(out.logprobs)
        gathered.prompt_logprobs.extend(out.prompt_logprobs)
        self.completion_tokens += len(out.token_ids)
        self.finish_reason = out.finish_reason
        return out

    def close(self) -> None:
        if self.first_token_at is None:
            self.series.waiting_queue_size.dec()

    def flush(self, last: worker_pb2.WorkerGenerateResponse) -> router_pb2.GenerateResponse:
        """Everything gathered for `last`'s sample since its previous flush; after the last sample's final output,
        with usage and timings."""
        gathered = self.gathered[last.index]
        response = router_pb2.GenerateResponse(request_id=self.request_id, text="".join(gathered.text),
                                               token_ids=gathered.token_ids, finish_reason=last.finish_reason,
                                               logprobs=gathered.logprobs, prompt_logprobs=gathered.prompt_logprobs,
                                               index=last.index)
        self.gathered[last.index] = _Gathered()
        if last.finish_reason:
            self.running -= 1
            if not self.running:
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
        self.series.generation_tokens.inc(self.completion_tokens)
        self.series.e2e_latency.observe(now - self.started)
        for tier, n in (("l1", l1), ("l2", copied - l3), ("l3", l3)):
            self.series.cached_tokens(tier).inc(n)
        loaded, rejected = stats.l1_load(self.leased_pages, self.usable_pages, l1, copied, self.page_size)
        self.series.l1_load_pages("loaded").inc(loaded)
        self.series.l1_load_pages("rejected").inc(rejected)

    def _from_l3(self, l1: int, copied: int) -> int:
        """Tokens the worker copied from L2 that were loaded from L3 for this request.

        The worker copied tokens [l1, l1 + copied) from L2; the pages loaded from L3 cover `reuse.l3_pages`.
        """
        loaded = self.reuse.l3_pages
        overlap = min(l1 + copied, loaded.stop * self.page_size) - max(l1, loaded.start * self.page_size)
        return max(0, overlap)
