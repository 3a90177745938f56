"""The router as a program backend: the public gRPC API (Generate, Tokenize, ListModels) and nothing else.

`Router` owns an asyncio event loop on a daemon thread and a `grpc.aio` channel bound to it; every call is a
coroutine on that loop (`submit` schedules one from any thread). A failed call raises `RouterError` with the gRPC
status and message. Nothing here is cached across calls except the model's page size and how many special tokens
the tokenizer puts before any text (both fixed for a served model).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import grpc

from radixserve.lang.transcript import Prompt, common_prefix
from radixserve.v1 import router_pb2, router_pb2_grpc

T = TypeVar("T")


class RouterError(Exception):
    """A call the router answered with a status other than OK."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


@dataclass(frozen=True)
class Completion:
    """One Generate call's answer; `ttft_s` from sending it to its first message, as the client saw it."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float


class Scored(NamedTuple):
    logprobs: list[float]
    prompt_tokens: int
    cached_tokens: int


class Router:
    """The router at `address` (host:port, plaintext). `timeout_s` bounds every call; `cache_salt` is sent with
    every Generate (tenants' cached prefixes are isolated by it)."""

    def __init__(self, address: str, timeout_s: float = 600, cache_salt: str = ""):
        self.address = address
        self._timeout_s = timeout_s
        self._salt = cache_salt
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="radixserve-lang", daemon=True).start()
        self._channel = self.call(self._open())
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._page_size: int | None = None
        self._lead: int | None = None

    async def _open(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.address)  # bound to the loop it is created on

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs `coro` on the backend's loop and waits for it (never from that loop)."""
        return self.submit(coro).result()

    def close(self) -> None:
        self.call(self._channel.close())
        self._loop.call_soon_threadsafe(self._loop.stop)

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- calls ------------------------------------------------------------------------------------------------
    async def generate(self, prompt: Prompt | Sequence[int], sampling: router_pb2.SamplingParams,
                       on_text: Callable[[str], None] = lambda text: None) -> Completion:
        """One streamed Generate of `prompt` (a Prompt, or token ids); `on_text` gets each text delta."""
        request = router_pb2.GenerateRequest(**await self._prompt_fields(prompt), sampling=sampling, stream=True,
                                             cache_salt=self._salt)
        started, first, pieces = time.perf_counter(), None, []
        with _translated():
            async for response in self._stub.Generate(request, timeout=self._timeout_s):
                first = first or time.perf_counter()
                pieces.append(response.text)
                on_text(response.text)
        usage = response.usage
        return Completion("".join(pieces), response.finish_reason, usage.prompt_tokens, usage.completion_tokens,
                          usage.cached_tokens, first - started)

    async def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The token ids Generate would run for `prompt`."""
        fields = await self._prompt_fields(prompt)
        return fields["token_ids"] if "token_ids" in fields else await self._tokenize(**fields)

    async def text_ids(self, text: str) -> list[int]:
        """The ids of `text` as a continuation: without the special tokens the tokenizer puts before a prompt."""
        if self._lead is None:
            self._lead = len(common_prefix(await asyncio.gather(self._tokenize(text="a"), self._tokenize(text="b"))))
        return (await self._tokenize(text=text))[self._lead:]

    async def logprobs_of(self, prefix_ids: Sequence[int], ids: Sequence[int]) -> Scored:
        """The logprob of each of `ids` after `prefix_ids` (non-empty), by prompt scoring from the first of `ids`:
        the server reuses the cached pages of `prefix_ids` for it."""
        sampling = router_pb2.SamplingParams(temperature=0, max_new_tokens=1, prompt_logprobs=True,
                                             prompt_logprobs_start=len(prefix_ids))
        request = router_pb2.GenerateRequest(token_ids=[*prefix_ids, *ids], sampling=sampling, cache_salt=self._salt)
        with _translated():
            (response,) = [r async for r in self._stub.Generate(request, timeout=self._timeout_s)]
        # entry i scores prompt token len(prefix_ids) + i
        return Scored([entry.logprob for entry in response.prompt_logprobs], response.usage.prompt_tokens,
                      response.usage.cached_tokens)

    async def prime(self, prompts: Sequence[Prompt]) -> Completion | None:
        """Computes the token prefix that all `prompts` share once, so that calls sent after it reuse it from the
        cache; None (nothing sent) where it is shorter than one cache page, which is all the cache can hold."""
        shared = common_prefix(await asyncio.gather(*map(self.prompt_ids, prompts)))
        if len(shared) < await self.page_size():
            return None
        return await self.generate(shared, router_pb2.SamplingParams(temperature=0, max_new_tokens=1))

    async def page_size(self) -> int:
        if self._page_size is None:
            with _translated():
                models = await self._stub.ListModels(router_pb2.ListModelsRequest(), timeout=self._timeout_s)
            self._page_size = models.models[0].page_size
        return self._page_size

    async def _tokenize(self, **fields) -> list[int]:
        with _translated():
            return list((await self._stub.Tokenize(router_pb2.TokenizeRequest(**fields),
                                                   timeout=self._timeout_s)).token_ids)

    async def _prompt_fields(self, prompt: Prompt | Sequence[int]) -> dict:
        """GenerateRequest fields for `prompt`: `text`, `messages` (a call right after `assistant(`: exactly what a
        client sending those messages gets), or token ids (the templated turns, then the open turn's text)."""
        if not isinstance(prompt, Prompt):
            return {"token_ids": list(prompt)}
        if prompt.turns is None:
            return {"text": prompt.text}
        messages = [router_pb2.ChatMessage(role=role, content=content) for role, content in prompt.turns]
        if not prompt.text:
            return {"messages": messages}
        turns, text = await asyncio.gather(self._tokenize(messages=messages), self.text_ids(prompt.text))
        return {"token_ids": turns + text}


@contextlib.contextmanager
def _translated() -> Iterator[None]:
    """Re-raises a gRPC error as RouterError."""
    try:
        yield
    except grpc.aio.AioRpcError as error:
        raise RouterError(error.code(), error.details()) from error
