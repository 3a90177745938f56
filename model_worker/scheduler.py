"""Continuous-batching scheduler: which sequences run in the next forward, and how many tokens each.

Per step (`schedule`):
  1. every running sequence that has finished its prompt decodes 1 token, and its draft if it has one (decode never
     waits for prefill);
  2. running sequences still in their prompt take prompt chunks, at most `chunked_prefill_size` tokens in all when
     step 1 decodes anything (a decode waits for the whole step), else at most `max_prefill_tokens` (nobody's next
     token waits: requests that arrive together prefill in one step and then decode in lock step, where a decode
     step of 4 costs about one of 1; the quick-suite's 4 x 256-token prompts fit one step, not two);
  3. waiting sequences are admitted first-come first-served while the token budget, `max_running_requests` (a
     request of n samples counts n) and the page reservation allow; admission stops at the first that does not
     fit (no overtaking). None is admitted while every running sequence is decoding its last
     `FINISHING_STEPS` tokens: they wait those few decode steps and start together with the sequences that take
     the finishing ones' places, instead of stalling the finishing ones' last tokens behind their prefill. A
     closed loop whose requests fell one step apart (one reached the worker past the arrival window) thus
     prefills its next round in one step and decodes it in lock step again; admitted at once, the late one's
     successor prefilled beside the others' decodes in every later round (quick-suite no-reuse workload: 27 ms
     between tokens in such runs against 21.5 in lock step).

Page reservation: a running sequence may need `pages_for(max_tokens - 1)` pages by its end (the last sampled token
is never fed back); one still to fork `forks` more samples needs that many times more, less the full prompt pages
they will share. Admission requires the free pages plus the evictable pages of the L1 prefix cache to cover the
not-yet-allocated part of every running sequence's need plus the newcomer's (counting its reused prefix pages as
new: a little conservative), so a step can always allocate its pages, evicting cached pages first when the free
list is short: no preemption, no OOM mid-decode.
A request whose pages are not free waits in the queue. Pages are allocated lazily, a page at a time.

The scheduler is not thread-safe; the engine calls it under its lock.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from model_worker.detokenizer import IncrementalDetokenizer, StopStringFilter
from model_worker.kv_pool import KVPool, pages_for_tokens
from model_worker.prefix_cache import CacheState, PrefixCache
from model_worker.request import RequestOutput, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar, GrammarMatcher

    from model_worker.speculation import NgramDrafter


PEAK_HORIZON_S = 1.0  # longer than a closed-loop round trip between two rounds, short enough to forget a burst
FINISHING_STEPS = 2  # a decode step here is ~20 ms at 4 rows, a prefill chunk beside it 150-500 ms


@dataclass(eq=False)
class Sequence:
    """Mutable state of one request inside the engine."""

    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    prompt_len: int
    max_tokens: int  # prompt + generated never exceeds this
    sampling: SamplingParams
    on_output: Callable[[RequestOutput], None]
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer
    stop_filter: StopStringFilter
    cache: CacheState
    arrival: float = field(default_factory=time.perf_counter)
    scheduled_at: float | None = None
    first_token_at: float | None = None
    num_computed: int = 0  # tokens whose K/V are in the pool
    finished: bool = False
    grammar: CompiledGrammar | None = None  # a constrained request's compiled constraint
    matcher: GrammarMatcher | None = None  # a constrained sequence's place in its grammar (`model_worker.grammar`)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # scored so far; sent with the first token
    draft: list[int] = field(default_factory=list)  # guessed next (`Engine._propose`), verified by the next forward
    drafter: NgramDrafter | None = None  # its text's index for prompt-lookup guesses, made at its first one
    index: int = 0  # which of the request's `sampling.n` samples this is
    forks: int = 0  # samples still to be forked from this one when its prefill ends (`Engine._fork`)
    blocked: bool = False  # a step passed it over: it waited in the queue for room (pages, batch, token budget)

    @property
    def key(self) -> tuple[str, int]:
        """Its block table's id in the pool: one per sample."""
        return self.request_id, self.index

    @property
    def reusable(self) -> list[int]:
        """The prompt as far as cached pages may stand for it: a request scoring its prompt from token s needs the
        logits of position s - 1 computed (`PrefixCache.attach` reuses one token short of what it is given)."""
        scored_from = self.sampling.prompt_logprobs_start if self.sampling.prompt_logprobs else self.prompt_len
        return self.token_ids[:min(scored_from, self.prompt_len)]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len


def pages_needed(seq: Sequence, page_size: int) -> int:
    """Pages `seq` may hold by its end, with the samples it is still to fork: K/V of every token but the last sampled
    one, each fork sharing the prompt's full pages."""
    own = pages_for_tokens(seq.max_tokens - 1, page_size)
    return own + seq.forks * (own - seq.prompt_len // page_size)


class ScheduledChunk(NamedTuple):
    """`length` tokens of `seq` from position `start`; `samples` when the chunk reaches the end of the sequence's
    known tokens (a decode with a draft runs past it, over the draft)."""

    seq: Sequence
    start: int
    length: int
    samples: bool


def chunk_of(seq: Sequence, length: int) -> ScheduledChunk:
    start = seq.num_computed
    return ScheduledChunk(seq, start, length, start + length >= len(seq.token_ids))


class Scheduler:
    def __init__(self, pool: KVPool, prefix: PrefixCache, max_running: int, chunked_prefill_size: int,
                 max_prefill_tokens: int) -> None:
        self.pool = pool
        self.prefix = prefix
        self.max_running = max_running
        self.chunked_prefill_size = chunked_prefill_size
        self.max_prefill_tokens = max(max_prefill_tokens, chunked_prefill_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.admitted = 0  # requests admitted since start, and how many of them were `blocked` first
        self.admitted_blocked = 0
        self._peak = (0, 0.0)  # the most sequences a step ran with recently, and when (`recent_peak`)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def recent_peak(self) -> int:
        """The most sequences a step ran with in the last `PEAK_HORIZON_S` (counted from when that count was last
        reached): how many requests a closed-loop client keeps in flight."""
        count, at = self._peak
        return count if time.perf_counter() - at <= PEAK_HORIZON_S else 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, request_id: str) -> list[Sequence]:
        """Takes the request's unfinished samples out of the queues and frees their pages."""
        removed = []
        for queue in (self.running, self.waiting):
            for seq in [s for s in queue if s.request_id == request_id]:
                queue.remove(seq)
                self._release(seq)
                removed.append(seq)
        return removed

    def finish(self, seq: Sequence) -> None:
        """Marks `seq` finished, drops it from the running set and frees its pages at once (cached pages stay)."""
        seq.finished = True
        self.running.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.prefix.finish(seq.key, seq.token_ids, seq.num_computed, seq.cache)
        self.pool.release(seq.key)

    def schedule(self) -> list[ScheduledChunk]:
        """The next step's chunks (prefill chunks first, then decodes), with their pages allocated."""
        decodes = [chunk_of(s, 1 + len(s.draft)) for s in self.running if s.num_computed >= s.prompt_len]
        prefills: list[ScheduledChunk] = []
        budget = self.chunked_prefill_size if decodes else self.max_prefill_tokens
        for seq in self.running:
            if budget > 0 and seq.num_computed < seq.prompt_len:
                prefills.append(chunk_of(seq, min(budget, seq.prompt_len - seq.num_computed)))
                budget -= prefills[-1].length
        finishing = bool(self.running) and not prefills and all(
            s.max_tokens - len(s.token_ids) <= FINISHING_STEPS for s in self.running)
        while budget > 0 and self.waiting and not finishing and self._can_admit(self.waiting[0]):
            seq = self.waiting.popleft()
            self.running.append(seq)
            self.admitted, self.admitted_blocked = self.admitted + 1, self.admitted_blocked + seq.blocked
            seq.num_computed = self.prefix.attach(seq.key, seq.reusable, seq.cache)
            prefills.append(chunk_of(seq, min(budget, seq.prompt_len - seq.num_computed)))
            budget -= prefills[-1].length
        if not finishing:  # room, not timing, held them back
            for seq in self.waiting:
                seq.blocked = True
        chunks = prefills + decodes
        if len(self.running) >= self.recent_peak():
            self._peak = (len(self.running), time.perf_counter())
        for chunk in chunks:
            end = chunk.start + chunk.length
            self.prefix.make_room(pages_for_tokens(end, self.pool.page_size) - len(self.pool.block_table(
                chunk.seq.key)))
            self.pool.ensure_capacity(chunk.seq.key, end)
        return chunks

    def _can_admit(self, seq: Sequence) -> bool:
        if sum(1 + s.forks for s in self.running) + 1 + seq.forks > self.max_running:
            return False
        outstanding = sum(self._unallocated(s) for s in self.running)
        available = self.pool.num_free + self.prefix.evictable_pages
        return available - outstanding >= pages_needed(seq, self.pool.page_size)

    def _unallocated(self, seq: Sequence) -> int:
        return pages_needed(seq, self.pool.page_size) - len(self.pool.block_table(seq.key))
