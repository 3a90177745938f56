"""Running programs: `ProgramState` (what `s` is), `Function` (what `@function` makes) and the default backend.

A state runs its operations in order, in the background, on its backend's event loop: `s += expr` checks the
expression's shape against the state at once (a ValueError at that line), queues it and returns, so the branches of
a `fork` run their calls concurrently while the program's Python code goes on. Reading (`s[name]`,
`s.text()`, `s.messages()`, `s.get_meta_info(name)`) waits for everything queued on that state before it, and
raises the state's error if one of its calls failed; after an error the state's later operations are skipped.

Cache use, on purpose:
- `s.fork(n)` (n > 1) first computes the prefix every branch will share (`Router.prime`), then starts the
  branches, so that each branch reuses it from the cache instead of all of them computing it at once.
- `run_batch` runs each program once without the model up to its first model call (its Python code until its
  first `gen`, `select`, `fork` or read) to learn the prompts the batch starts with, primes their common token
  prefix, then runs the batch.
- `state.cached_tokens` / `state.prompt_tokens`: the prompt tokens this state's own calls (its priming
  included, its forks' not) reused from the cache / sent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

from radixserve.lang.backend import Completion, Router
from radixserve.lang.ir import Constraint, Expr, Gen, Op, RoleBegin, RoleEnd, SamplingOptions, Select, Text, flatten
from radixserve.lang.transcript import Prompt, Transcript, best_choice, choice_score
from radixserve.v1 import router_pb2

# NOTE: SGLang's API has one process-wide default backend (`set_default_backend`); this is that setting.
_default_backend: Router | None = None


def set_default_backend(backend: Router) -> None:
    global _default_backend
    _default_backend = backend


@dataclass(frozen=True)
class Selection:
    """A `select`'s result: the choice picked, and every choice's score (`choice_score`), in order."""

    choice: str
    scores: tuple[float, ...]


def _shaped(transcript: Transcript, ops: list[Op]) -> Transcript:
    """`transcript` after `ops`, every model call's output left empty: raises the ValueError a program meets at
    this `+=`."""
    for op in ops:
        if isinstance(op, Gen | Select):
            transcript.prompt()
        else:
            transcript = _applied(transcript, op)
    return transcript


def _applied(transcript: Transcript, op: Text | RoleBegin | RoleEnd) -> Transcript:
    if isinstance(op, Text):
        return transcript.append(op.text)
    return transcript.begin(op.role) if isinstance(op, RoleBegin) else transcript.end()


def _sampling(options: SamplingOptions, constraint: Constraint | None) -> router_pb2.SamplingParams:
    params = router_pb2.SamplingParams(max_new_tokens=options.max_tokens, stop=options.stop,
                                       temperature=options.temperature, top_p=options.top_p, top_k=options.top_k,
                                       seed=options.seed)
    if constraint is not None:
        if constraint.kind == "choices":
            params.choices.extend(constraint.spec)
        else:
            setattr(params, constraint.kind, constraint.spec)
    return params


class ProgramState:
    """The state `s` of one running program (or one branch of a fork)."""

    def __init__(self, backend: Router, defaults: SamplingOptions, shape: Transcript = Transcript(),  # noqa: B008 -- immutable
                 stream: bool = False):
        self._backend = backend
        self._defaults = defaults
        self._shape = shape              # the transcript as queued (outputs left empty), for checking `+=`
        self._transcript = Transcript()  # as run
        self._tail: concurrent.futures.Future | None = None  # the last queued operation
        self._variables: dict[str, str] = {}
        self._meta: dict[str, Completion | Selection] = {}
        self._forks: list[ProgramState] = []
        self._stream: queue.Queue[str | None] | None = queue.Queue() if stream else None
        self.error: Exception | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0

    # -- what programs call -----------------------------------------------------------------------------------
    def __iadd__(self, expr: Expr | str) -> ProgramState:
        ops = flatten(expr)
        self._shape = _shaped(self._shape, ops)
        self._then(lambda: self._run(ops))
        return self

    def __getitem__(self, name: str) -> str:
        self.sync()
        return self._variables[name]

    def get_meta_info(self, name: str) -> Completion | Selection:
        self.sync()
        return self._meta[name]

    def fork(self, size: int) -> list[ProgramState]:
        """`size` states that continue this one from here; this one's results before the fork are theirs too."""
        forks = [ProgramState(self._backend, self._defaults, self._shape) for _ in range(size)]
        self._forks.extend(forks)
        self._then(lambda: self._prime_for(size))
        split = self._tail  # its result: the transcript at the fork, or None where this state had failed
        for state in forks:
            state._then(functools.partial(state._inherit, split, self))
        return forks

    def text(self) -> str:
        self.sync()
        return self._transcript.text()

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        return self._transcript.messages()

    def text_iter(self) -> Iterator[str]:
        """With `run(stream=True)`: the state's text as it is appended (generated text as it is generated), until
        the program ends; then its error, if any, is raised."""
        while (piece := self._stream.get()) is not None:
            yield piece
        self._raise()

    async def text_async_iter(self) -> AsyncIterator[str]:
        """`text_iter` for asyncio code."""
        while (piece := await asyncio.to_thread(self._stream.get)) is not None:
            yield piece
        self._raise()

    def sync(self) -> None:
        """Waits for every operation queued on this state; raises its error."""
        if self._tail is not None:
            self._tail.result()
        self._raise()

    # -- running ------------------------------------------------------------------------------------------------
    def _then(self, work: Callable[[], Awaitable[object]]) -> None:
        """Queues `work` after the last queued operation; skipped once the state has failed. The queued future's
        result is `work`'s."""
        previous = self._tail

        async def step():
            if previous is not None:
                await asyncio.wrap_future(previous)
            if self.error is None:
                try:
                    return await work()
                except Exception as error:  # noqa: BLE001 -- the program's failure, raised where it reads the state
                    self.error = error

        self._tail = self._backend.submit(step())

    async def _run(self, ops: list[Op]) -> None:
        for op in ops:
            if isinstance(op, Gen):
                await self._gen(op)
            elif isinstance(op, Select):
                await self._select(op)
            else:
                if isinstance(op, RoleBegin) and self._transcript.turns:
                    self._emit("\n")  # text() puts one turn per line
                elif isinstance(op, Text):
                    self._emit(op.text)
                self._transcript = _applied(self._transcript, op)

    async def _gen(self, op: Gen) -> None:
        completion = await self._backend.generate(self._transcript.prompt(),
                                                  _sampling(op.sampling.over(self._defaults), op.constraint),
                                                  self._emit)
        self._count(completion)
        self._transcript = self._transcript.append(completion.text)
        self._store(op.name, completion.text, completion)

    async def _select(self, op: Select) -> None:
        prefix = await self._backend.prompt_ids(self._transcript.prompt())
        choices = await asyncio.gather(*map(self._backend.text_ids, op.choices))
        scored = await asyncio.gather(*(self._backend.logprobs_of(prefix, ids) for ids in choices))
        self.prompt_tokens += sum(s.prompt_tokens for s in scored)
        self.cached_tokens += sum(s.cached_tokens for s in scored)
        scores = tuple(choice_score(s.logprobs) for s in scored)
        choice = op.choices[best_choice(scores)]
        self._transcript = self._transcript.append(choice)
        self._emit(choice)
        self._store(op.name, choice, Selection(choice, scores))

    async def _prime_for(self, size: int) -> Transcript:
        if size > 1:
            primed = await self._backend.prime(self._transcript.fork_prompts())
            if primed is not None:
                self._count(primed)
        return self._transcript

    async def _inherit(self, split: concurrent.futures.Future, parent: ProgramState) -> None:
        """A fork's first operation: the parent's transcript at the fork, or the parent's error."""
        at_fork = await asyncio.wrap_future(split)
        if at_fork is None:
            raise parent.error
        self._transcript = at_fork

    def _count(self, completion: Completion) -> None:
        self.prompt_tokens += completion.prompt_tokens
        self.cached_tokens += completion.cached_tokens

    def _store(self, name: str | None, value: str, meta: Completion | Selection) -> None:
        if name is not None:
            self._variables[name] = value
            self._meta[name] = meta

    def _emit(self, text: str) -> None:
        if self._stream is not None and text:
            self._stream.put(text)

    def _end_stream(self) -> None:
        if self._stream is not None:
            self._stream.put(None)

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _finish(self) -> None:
        """Waits for this state and all its forks, then raises the first error among them."""
        tree = self._tree()
        for state in tree:
            if state._tail is not None:
                state._tail.result()
        for state in tree:
            state._raise()

    def _tree(self) -> list[ProgramState]:
        return [self, *(state for fork in self._forks for state in fork._tree())]


# run(...) and run_batch(...) keywords that set every gen's default (SGLang's names), unless the program takes a
# parameter of that name
_RUN_DEFAULTS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "stop": "stop", "seed": "seed"}


class Function:
    """A program (`@function`): `func(s, *args, **kwargs)` appends to the state `s`."""

    def __init__(self, func: Callable[..., None]):
        functools.update_wrapper(self, func)
        self._func = func
        self._parameters = frozenset(inspect.signature(func).parameters)

    def run(self, *args, backend: Router | None = None, stream: bool = False, **kwargs) -> ProgramState:
        """Runs the program. Without `stream`: returns when it and all its calls (its forks' too) have finished,
        raising the first error. With `stream`: returns at once; read it with `state.text_iter()`."""
        arguments, defaults = self._split(kwargs)
        state = ProgramState(_resolve(backend), defaults, stream=stream)
        if stream:
            threading.Thread(target=self._run_into, args=(state, args, arguments), daemon=True).start()
        else:
            self._func(state, *args, **arguments)
            state._finish()
        return state

    def run_batch(self, batch_kwargs: list[dict], backend: Router | None = None, max_concurrency: int = 16,
                  **kwargs) -> list[ProgramState]:
        """Runs the program once per entry of `batch_kwargs`, at most `max_concurrency` at a time, after priming
        the prefix the batch's first calls share. A program that fails fails alone: its state's `error` is set
        and reading it raises that error."""
        backend = _resolve(backend)
        runs = [self._split({**kwargs, **entry}) for entry in batch_kwargs]
        prompts = [prompt for prompt in (self._first_prompt(arguments) for arguments, _ in runs) if prompt]
        if len(prompts) > 1:
            backend.call(backend.prime(prompts))
        states = [ProgramState(backend, defaults) for _, defaults in runs]
        with concurrent.futures.ThreadPoolExecutor(max_concurrency, thread_name_prefix="program") as pool:
            list(pool.map(self._run_into, states, [()] * len(states), [arguments for arguments, _ in runs]))
        return states

    async def run_async(self, *args, **kwargs) -> ProgramState:
        """`run` for asyncio code (the program's Python code runs on a thread)."""
        return await asyncio.to_thread(self.run, *args, **kwargs)

    async def run_batch_async(self, batch_kwargs: list[dict], **kwargs) -> list[ProgramState]:
        """`run_batch` for asyncio code."""
        return await asyncio.to_thread(self.run_batch, batch_kwargs, **kwargs)

    def _run_into(self, state: ProgramState, args: tuple, arguments: dict) -> None:
        """Runs the program on `state` to its end, its error kept in `state.error`; ends `state`'s stream."""
        try:
            self._func(state, *args, **arguments)
            state._finish()
        except Exception as error:  # noqa: BLE001 -- a failed program fails alone, kept on its state
            state.error = state.error or error
        finally:
            state._end_stream()

    def _split(self, kwargs: dict) -> tuple[dict, SamplingOptions]:
        """(the program's arguments, the gens' defaults) from run's keywords."""
        options = {_RUN_DEFAULTS[k]: v for k, v in kwargs.items() if k in _RUN_DEFAULTS and k not in self._parameters}
        if isinstance(options.get("stop"), str):
            options["stop"] = (options["stop"],)
        arguments = {k: v for k, v in kwargs.items() if k not in _RUN_DEFAULTS or k in self._parameters}
        return arguments, SamplingOptions(**{**options, "stop": tuple(options.get("stop") or ())})

    def _first_prompt(self, arguments: dict) -> Prompt | None:
        """The prompt of the program's first model call (or of its state at its first fork or read), found by
        running it without the model; None where it makes none or fails first (its real run reports that)."""
        try:
            self._func(_Probe(), **arguments)
        except _Reached as reached:
            return reached.prompt
        except Exception:  # noqa: BLE001 -- the real run raises it
            return None
        return None


def function(func: Callable[..., None]) -> Function:
    return Function(func)


def _resolve(backend: Router | None) -> Router:
    if backend is None and _default_backend is None:
        raise ValueError("no backend: pass backend= or call set_default_backend(Router(...)) first")
    return backend or _default_backend


class _Reached(Exception):
    def __init__(self, prompt: Prompt | None):
        super().__init__()
        self.prompt = prompt


class _Probe:
    """A stand-in state that stops its program at the first thing needing the model: a gen or select, a fork, a
    read."""

    def __init__(self):
        self._shape = Transcript()

    def __iadd__(self, expr: Expr | str) -> _Probe:
        for op in flatten(expr):
            if isinstance(op, Gen | Select):
                raise _Reached(self._shape.prompt())
            self._shape = _applied(self._shape, op)
        return self

    def __getitem__(self, name: str):
        raise _Reached(next(iter(self._shape.fork_prompts()), None))

    def __getattr__(self, name: str):  # fork, text(), messages(), ...
        raise _Reached(next(iter(self._shape.fork_prompts()), None))
