"""gRPC glue for the worker: translates `radixserve.v1.Worker` calls to `Engine` calls and back. No logic here,
except where work happens: a constraint compiles on the service's one compiling thread, never on the event loop
or the engine's step thread, before the request is queued."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from xgrammar import CompiledGrammar

from model_worker.engine import Engine, Overloaded
from model_worker.prefix_cache import CacheRequest, L2Lease
from model_worker.request import Constraint, ConstraintKind, RequestOutput, SamplingParams, TokenLogprob
from radixserve import tracing
from radixserve.server import ServiceError
from radixserve.v1 import router_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger("model_worker.service")

OVERLOAD_RETRY_S = 1.0  # about one long prefill here: the queue has moved by then


def sampling_from_pb(s: worker_pb2.ResolvedSampling) -> SamplingParams:
    """Raises ValueError for values the engine refuses (the router checks them first)."""
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
                          stop=tuple(s.stop), seed=s.seed if s.HasField("seed") else None, ignore_eos=s.ignore_eos,
                          constraint=constraint_from_pb(s), logprobs=s.logprobs, top_logprobs=s.top_logprobs,
                          prompt_logprobs=s.prompt_logprobs, prompt_logprobs_start=s.prompt_logprobs_start or 1,
                          n=s.n or 1, stop_token_ids=tuple(s.stop_token_ids))


def constraint_from_pb(s: worker_pb2.ResolvedSampling) -> Constraint | None:
    """Raises ValueError when more than one constraint is set."""
    given = [Constraint(kind, getattr(s, kind.value)) for kind in ConstraintKind
             if kind is not ConstraintKind.CHOICES and s.HasField(kind.value)]
    if s.choices:
        given.append(Constraint(ConstraintKind.CHOICES, tuple(s.choices)))
    if len(given) > 1:
        raise ValueError(f"at most one constraint may be set; got {', '.join(c.kind.value for c in given)}")
    return given[0] if given else None


def logprobs_to_pb(logprobs: tuple[TokenLogprob, ...]) -> list[router_pb2.TokenLogprobs]:
    return [router_pb2.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, top=[
        router_pb2.Logprob(token_id=token, logprob=logprob) for token, logprob in lp.top]) for lp in logprobs]


def cache_from_pb(request: worker_pb2.WorkerGenerateRequest, trace: tuple[tuple[str, str], ...] = ()
                  ) -> CacheRequest:
    """Raises ValueError for a lease that is malformed in itself. `trace` parents the request's commit spans."""
    lease = request.l2_lease if request.HasField("l2_lease") else None
    return CacheRequest(salt=request.cache_salt, enabled=not request.disable_cache, l2_lease=lease and L2Lease(
        lease.lease_id, lease.segment_name, tuple(lease.slots), tuple(lease.generations), lease.expires_unix_ms),
        trace=trace)


def output_to_pb(out: RequestOutput) -> worker_pb2.WorkerGenerateResponse:
    return worker_pb2.WorkerGenerateResponse(
        text=out.text, token_ids=out.token_ids, finish_reason=out.finish_reason or "",
        cached_tokens_l1=out.cached_tokens_l1 or 0, cached_tokens_l2=out.cached_tokens_l2 or 0,
        queue_ms=out.queue_ms or 0.0, prefill_ms=out.prefill_ms or 0.0, logprobs=logprobs_to_pb(out.logprobs),
        prompt_logprobs=logprobs_to_pb(out.prompt_logprobs), index=out.index)


class _Trace:
    """One Generate call's span, and the engine's phases recorded under it after the fact when the call ends:
    queue, L2 -> L1 copy (when it came with a lease), prefill and decode. The engine timed them (`queue_ms`,
    `l2_copy_ms`, `prefill_ms` of sample 0's final output); arrival and the end of decoding are this clock's. Every
    method returns at once when tracing is off."""

    def __init__(self, request: worker_pb2.WorkerGenerateRequest, parent):
        self.span = tracing.start("worker.generate", tracing.SpanKind.SERVER, parent, {
            "radixserve.request_id": request.request_id, "radixserve.prompt_tokens": len(request.prompt_ids)})
        self._leased = request.HasField("l2_lease")
        self._added_ns = 0
        self._final: RequestOutput | None = None
        self._tokens = 0

    def added(self) -> None:
        if self.span.is_recording():
            self._added_ns = time.time_ns()

    def saw(self, out: RequestOutput) -> None:
        if self.span.is_recording():
            self._tokens += len(out.token_ids)
            if out.finish_reason is not None and out.index == 0:
                self._final = out

    def end(self) -> None:
        final, span = self._final, self.span
        if final is not None and self._added_ns:
            ns = lambda ms: round((ms or 0.0) * 1e6)
            queued = self._added_ns + ns(final.queue_ms - (final.l2_copy_ms or 0.0))
            scheduled = self._added_ns + ns(final.queue_ms)
            first_token = scheduled + ns(final.prefill_ms)
            cached = {"radixserve.cached_tokens.l1": final.cached_tokens_l1 or 0,
                      "radixserve.cached_tokens.l2": final.cached_tokens_l2 or 0}
            tracing.record("worker.queue", span, self._added_ns, queued)
            if self._leased:
                tracing.record("worker.l2_to_l1_copy", span, queued, scheduled, cached)
            tracing.record("worker.prefill", span, scheduled, first_token)
            tracing.record("worker.decode", span, first_token, time.time_ns(), {
                "radixserve.completion_tokens": self._tokens, "radixserve.finish_reason": final.finish_reason})
            span.set_attributes({**cached, "radixserve.finish_reason": final.finish_reason})
        span.end()


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Each Generate call streams one engine request, all its samples interleaved, until each has ended; a cancelled
    call (client gone, deadline) aborts it, and a sample that fails fails the call."""

    def __init__(self, engine: Engine, model_path: str, max_running_requests: int):
        self._engine = engine
        self._model_path = model_path
        self._max_running = max_running_requests
        # One thread: compilations queue behind each other (the engine's grammar cache serializes them anyway) and
        # take at most one core from the engine.
        self._compiling = ThreadPoolExecutor(1, thread_name_prefix="grammar")

    async def Generate(self, request: worker_pb2.WorkerGenerateRequest, context):
        trace = _Trace(request, tracing.incoming(context))
        try:
            async for response in self._generate(request, trace):
                yield response
        finally:
            trace.end()

    async def _generate(self, request: worker_pb2.WorkerGenerateRequest, trace: _Trace):
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        try:
            # a malformed lease is not trusted even to be released
            cache = cache_from_pb(request, tracing.outgoing(trace.span) or ())
            sampling, grammar = await self._prepare(request, cache)
            trace.added()
            self._engine.add_request(request.request_id, list(request.prompt_ids), sampling,
                                     lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out), cache, grammar)
        except ValueError as e:  # add_request released the lease of what it refused
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except Overloaded as e:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"worker overloaded: {e}",
                               retry_after_s=OVERLOAD_RETRY_S) from None
        running = sampling.n
        try:
            while running:
                out = await outputs.get()
                running -= out.finish_reason is not None
                trace.saw(out)
                if out.finish_reason == "error":
                    raise ServiceError(grpc.StatusCode.INTERNAL, f"request {request.request_id} failed: {out.error}")
                yield output_to_pb(out)
        finally:
            if running:
                self._engine.abort(request.request_id)

    async def _prepare(self, request: worker_pb2.WorkerGenerateRequest, cache: CacheRequest
                       ) -> tuple[SamplingParams, CompiledGrammar | None]:
        """The request's sampling and its compiled constraint; a refusal (ValueError) or a cancellation while
        compiling releases the request's lease."""
        try:
            sampling = sampling_from_pb(request.sampling)
            if sampling.constraint is None:
                return sampling, None
            loop = asyncio.get_running_loop()
            return sampling, await loop.run_in_executor(self._compiling, self._engine.grammars.compile,
                                                        sampling.constraint)
        except BaseException:
            self._engine.discard(cache)
            raise

    async def GetInfo(self, request, context) -> worker_pb2.WorkerInfo:
        info = self._engine.info
        load = self._engine.load()
        return worker_pb2.WorkerInfo(
            model=router_pb2.ModelInfo(name=info.name, fingerprint=info.fingerprint, dtype=info.dtype,
                                       max_context=info.max_context, vocab_size=info.vocab_size,
                                       page_size=info.page_size),
            model_path=self._model_path, max_running_requests=self._max_running,
            running_requests=load.running, waiting_requests=load.waiting, kv_pages_used=load.pages_used,
            kv_pages_total=load.pages_total, kv_pages_cached=load.pages_cached,
            kvcached_segment=self._engine.kvcache.segment_name if self._engine.kvcache is not None else "",
            admitted_requests=load.admitted, blocked_requests=load.blocked)
