"""The model engine: requests in, token/text deltas out, continuous batching over the paged KV pool.

Threading contract:
- `add_request` and `abort` may be called from any thread; they take the engine lock briefly.
- The step loop (`start()` runs it on a background thread; tests call `step()` directly) schedules under the lock,
  runs the forward WITHOUT it, then samples and emits outputs under it again.
- `on_output` is called with the engine lock held, from the engine thread — except the final "abort" output, which
  `abort` delivers on the caller's thread. Because both hold the lock, a request's "abort" output is always its
  last. Callbacks must be cheap and must not block (e.g. `queue.put_nowait` / `loop.call_soon_threadsafe`).
- `abort` frees the request's pages at once. A forward already in flight may still write to those pages; nothing
  can reuse them before that forward ends, because allocation happens only in `schedule`, under the lock.
- `start()` frees the calling thread's OpenMP threads (`release_openmp_threads`): torch work on other threads
  while the loop runs gives libgomp more threads than cores, and it then slows every forward. It also shortens the
  process's GIL switch interval to `GIL_SWITCH_INTERVAL_S`: a forward takes the GIL back between its ~250 ops, and
  while the service's event loop streams a step's tokens it waited up to CPython's default 5 ms each time.

Faults stay with the request that caused them: a batched forward that raises is run again one request at a time,
and a request whose own forward or sampling fails ends alone with finish_reason "error" (its `error` says why).
The queue is bounded (`max_waiting_requests`, `max_waiting_tokens`): past it `add_request` raises `Overloaded`. If
the step loop itself dies, `start`'s `on_death` runs, so the process can stop serving and exit.

Constrained requests (`SamplingParams.constraint`) arrive with their grammar compiled (`Engine.grammars.compile`,
off the step thread); each gets a matcher, the batch's bitmask masks their logits before sampling, and the matcher
accepts every sampled token (the grammar allows EOS only where the output is complete). Logprobs are of the model's
raw distribution (`model_worker.sampler`). A request with `prompt_logprobs` gets logits for every prompt position
it computes, and reuses cached pages only before `prompt_logprobs_start - 1` (`Sequence.reusable`): a cached page
has no logits to score.

    logits rows of one step, per chunk:  | scored prompt chunk: one per position | sampling chunk: its last | ...
    row of position p scores token p + 1; the row of the prompt's last position samples the first output token

Jump-forward: after each token of a greedy constrained sequence, the string its grammar forces next (a fixed key, a
closing quote) is tokenized into a draft (`_propose`), and the next decode runs the sampled token and the draft in
one forward, one logits row per position. Row j's masked argmax is what a decode step after draft[:j] would choose:
draft tokens are taken while they agree with it, then its own choice (`_verify`); so the output is token-by-token
greedy decoding's, in fewer forwards. `--disable-jump-forward` turns it off. With `--speculative-tokens N`, other
greedy sequences get drafts the same way, looked up in their own text (`model_worker.speculation`).

A request of `n` samples is one sequence until its prefill ends; then it forks `n - 1` more (`_fork`), which share
its prompt's full pages (a partial last page is copied) and its cached-path lease, and sample their first tokens
from the same logits row. Sample i has its own generator (seeded `seed + i`, as vLLM seeds its child requests),
matcher, detokenizer and stop filter, and ends with its own final output (`RequestOutput.index`); samples that were
never forked end with the first (abort, error). Admission reserves the pages and running slots of all n.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from model_worker import cpu_kernels
from model_worker.attention import Chunk, PagedCpuBackend, select_backend
from model_worker.block_copy import block_copy_for
from model_worker.config import DType, EngineConfig
from model_worker.detokenizer import IncrementalDetokenizer, StopStringFilter
from model_worker.grammar import Grammars, TokenMask, new_matcher
from model_worker.kv_pool import KVPool, pages_for_budget
from model_worker.kvcache_client import KVCacheClient
from model_worker.loader import weights_digest
from model_worker.model import CausalLM, load_model, rope_tables
from model_worker.prefix_cache import CacheRequest, CacheState, PrefixCache
from model_worker.request import RequestOutput, SamplingParams, TokenLogprob
from model_worker.sampler import SAMPLING_EPS, SamplingRow, make_generator, sample, token_logprobs
from model_worker.scheduler import ScheduledChunk, Scheduler, Sequence, pages_needed
from model_worker.speculation import NgramDrafter
from radixserve.blocks.geometry import BlockGeometry

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

log = logging.getLogger("model_worker.engine")
# No-reuse quick-suite workload on our stack, 3 alternating pairs of runs, 0.5 vs 5 ms: decode forward (4 rows)
# median 40-47 vs 47-57 ms, inter-token latency 53-61 vs 60-69 ms, the step's sampling and emitting 2.1-2.6 vs
# 3.0-3.8 ms (docs/design.md section 9).
GIL_SWITCH_INTERVAL_S = 0.0005
GREEDY_ROW = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, generator=None)
# Most decode rows a step's prompt-lookup drafts may bring it to: 4 sequences get 2 tokens each. A decode is bound by
# reading the weights up to about that many rows (the model's linears at 4, 12, 16 and 20 rows: 11.4, 12.4, 13.5 and
# 15.3 ms; AMD EPYC, 2 cores).
DRAFT_ROWS = 12


class Overloaded(RuntimeError):
    """The waiting queue is full; the message says which bound."""


@dataclass(frozen=True)
class EngineInfo:
    name: str
    fingerprint: str  # namespace of cache block keys: weights, dtype, KV shape/layout and the kernels computing K/V
    dtype: str
    max_context: int
    vocab_size: int
    page_size: int
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Load:
    running: int
    waiting: int
    pages_used: int
    pages_total: int
    pages_cached: int
    admitted: int = 0  # requests admitted since start (`Scheduler.admitted`), and those blocked first
    blocked: int = 0


def resolve_dtype(dtype: DType, device: torch.device) -> torch.dtype:
    """AUTO: bfloat16 on a CUDA device that supports it, float32 on CPUs. Even with AVX512-BF16 (no AMX), bf16
    GEMMs measured slower than float32 at prefill sizes here, and bf16 greedy outputs changed with a cache hit on
    23 of 200 prompts (float32: 0), docs/design.md section 9."""
    if dtype is DType.AUTO:
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if dtype is DType.BFLOAT16 else torch.float32


def eos_ids(model_dir: Path, hf_config: object, tokenizer: object) -> tuple[int, ...]:
    """Union of the eos ids in config.json, generation_config.json and the tokenizer."""
    found: list[object] = [getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    generation_config = model_dir / "generation_config.json"
    if generation_config.exists():
        found.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    ids: set[int] = set()
    for value in found:
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return tuple(sorted(ids))


def release_openmp_threads() -> None:
    """Frees the calling thread's OpenMP worker threads (`omp_pause_resource_all(omp_pause_soft)`, OpenMP 5.0).

    Every thread that runs a parallel torch op keeps its own team of OpenMP threads. When libgomp (torch's CPU
    build) manages more of them than there are CPUs, it throttles their spin-waits to 100 spins, so every parallel
    region wakes its team through the kernel. On 2 cores, after the main thread had loaded the model, a 2,000-token
    prefill on another thread used 1.2-1.5 cores and ran 1.3-1.7x slower than on the main thread; with the main
    thread's team freed, it used 1.9 and ran as fast. A runtime without the call is left as it is.
    """
    for library in (None, "libgomp.so.1"):
        try:
            ctypes.CDLL(library).omp_pause_resource_all(1)  # 1 = omp_pause_soft
            return
        except (OSError, AttributeError):
            continue


def _scores_prompt(chunk: ScheduledChunk) -> bool:
    return chunk.seq.sampling.prompt_logprobs and chunk.start < chunk.seq.prompt_len


def _drafts(chunk: ScheduledChunk) -> bool:
    """The chunk runs past the sequence's known tokens, over its draft."""
    return chunk.start + chunk.length > len(chunk.seq.token_ids)


def _rows_of(chunk: ScheduledChunk) -> int:
    """Logits rows `chunk` needs: one per position of a prompt chunk whose request scores its prompt or of a decode
    with a draft, else one if it samples."""
    return chunk.length if _scores_prompt(chunk) or _drafts(chunk) else int(chunk.samples)


class Engine:
    """Loads a model and serves requests; see the module docstring for the threading contract."""

    def __init__(self, model_dir: Path, config: EngineConfig) -> None:
        from transformers import AutoConfig, AutoTokenizer

        model_dir = Path(model_dir)
        self.config = config
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = resolve_dtype(config.dtype, self.device)
        hf_config = AutoConfig.from_pretrained(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        kernels = (self.device.type == "cpu" and self.dtype == torch.float32 and not config.disable_cpu_kernels
                   and cpu_kernels.load())
        self.model: CausalLM = load_model(model_dir, hf_config, self.dtype, self.device, kernels)
        shape = self.model.shape
        self.geometry = BlockGeometry(shape.num_layers, shape.num_kv_heads, shape.head_dim, config.page_size,
                                      str(self.dtype).removeprefix("torch."))
        num_pages = config.num_pages or pages_for_budget(config.l1_cache_size_gb, self.geometry)
        self.pool = KVPool(num_pages, self.geometry, self.device)
        backend = select_backend(self.pool, shape.num_heads, shape.num_kv_heads, shape.head_dim, kernels)
        self.model.bind(backend, rope_tables(hf_config, shape.head_dim, shape.max_position_embeddings, self.dtype,
                                             self.device))
        self.backend = backend
        # a draft's rows must compute as each would alone (`model_worker.speculation`): the CPU kernels' rows do
        self._speculative_tokens = config.speculative_tokens if isinstance(backend, PagedCpuBackend) else 0
        self.info = self._make_info(model_dir, hf_config, kernels)
        self._eos = frozenset(self.info.eos_token_ids)
        self.grammars = Grammars(self.tokenizer, self.info.vocab_size, self.info.eos_token_ids)
        self._mask = TokenMask(config.max_running_requests, self.info.vocab_size)
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        self.kvcache = (KVCacheClient(config.kvcached, config, self.info.fingerprint, self.geometry, self.pool.kv,
                                      config.kvcached_timeout_ms / 1e3, block_copy_for(self.device))
                        if config.kvcached else None)
        self.prefix = PrefixCache(self.pool, self.info.fingerprint, self.kvcache, lock,
                                  block_copy_for(self.device, waited_for=True))
        self.scheduler = Scheduler(self.pool, self.prefix, config.max_running_requests, config.chunked_prefill_size,
                                   config.max_prefill_tokens)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead = False  # the step loop died (see `start`)
        log.info("engine ready", extra={"model": self.info.name, "dtype": self.info.dtype, "pages": num_pages,
                                        "page_size": config.page_size})

    def _make_info(self, model_dir: Path, hf_config: object, kernels: bool) -> EngineInfo:
        g = self.geometry
        # K/V computed by other kernels round differently: a block from them would change this worker's outputs
        compute = f"cpu-kernels-{cpu_kernels.build_directory().name}" if kernels else f"torch-{torch.__version__}"
        parts = [weights_digest(model_dir), g.dtype, g.num_layers, g.num_kv_heads, g.head_dim, g.page_size, g.layout,
                 compute]
        return EngineInfo(
            name=model_dir.name,
            fingerprint=hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest(),
            dtype=g.dtype,
            max_context=self.model.shape.max_position_embeddings,
            vocab_size=self.model.shape.vocab_size,
            page_size=g.page_size,
            eos_token_ids=eos_ids(model_dir, hf_config, self.tokenizer),
        )

    # -- requests ----------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                    on_output: Callable[[RequestOutput], None], cache: CacheRequest = CacheRequest(),
                    grammar: CompiledGrammar | None = None) -> None:
        """Queues a request; raises ValueError when it can never run (empty, too long, bad ids, duplicate id, a
        constraint without its grammar), and `Overloaded` when the queue is full.

        `cache` says whether its prefix may be reused and cached, and carries its kvcached lease, which the
        engine releases in every case (used, unusable, refused, or the request aborted before it ran).
        `grammar` is `self.grammars.compile(sampling.constraint)`, given exactly when there is a constraint.
        """
        state = CacheState(cache)
        with self._cond:
            try:
                if (grammar is None) != (sampling.constraint is None):
                    raise ValueError("a constrained request needs its compiled grammar, and only it has one")
                if sampling.n > self.config.max_running_requests:
                    raise ValueError(f"n ({sampling.n}) exceeds the {self.config.max_running_requests} sequences "
                                     "this worker runs at once (--max-running-requests)")
                seq = self._new_sequence(request_id, list(prompt_ids), sampling, on_output, state)
                seq.grammar = grammar
                seq.matcher = new_matcher(grammar) if grammar is not None else None
                if any(s.request_id == request_id for s in (*self.scheduler.running, *self.scheduler.waiting)):
                    raise ValueError(f"request id {request_id!r} is already running")
                self._check_room(seq)
            except (ValueError, Overloaded):
                self.prefix.discard(state)
                raise
            self.scheduler.add(seq)
            self._cond.notify()

    def _new_sequence(self, request_id: str, prompt: list[int], sampling: SamplingParams,
                      on_output: Callable[[RequestOutput], None], cache: CacheState) -> Sequence:
        max_context = self.info.max_context
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= max_context:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in the context of {max_context}")
        if min(prompt) < 0 or max(prompt) >= self.info.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.info.vocab_size})")
        seq = Sequence(
            request_id=request_id, token_ids=prompt, prompt_len=len(prompt),
            max_tokens=min(len(prompt) + sampling.max_new_tokens, max_context), sampling=sampling,
            on_output=on_output,
            generator=make_generator(sampling.seed, self.device) if sampling.temperature >= SAMPLING_EPS else None,
            detokenizer=IncrementalDetokenizer(self.tokenizer), stop_filter=StopStringFilter(sampling.stop),
            cache=cache,
        )
        seq.forks = sampling.n - 1
        if pages_needed(seq, self.pool.page_size) > self.pool.num_pages:
            samples = f" x {sampling.n} samples" if sampling.n > 1 else ""
            raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens {sampling.max_new_tokens}{samples} "
                             f"needs {pages_needed(seq, self.pool.page_size)} KV pages; the pool has "
                             f"{self.pool.num_pages}")
        return seq

    def _check_room(self, seq: Sequence) -> None:
        waiting = self.scheduler.waiting
        if len(waiting) >= self.config.max_waiting_requests:
            raise Overloaded(f"{len(waiting)} requests are waiting (--max-waiting-requests)")
        tokens = sum(s.prompt_len for s in waiting)
        if waiting and tokens + seq.prompt_len > self.config.max_waiting_tokens:
            raise Overloaded(f"{tokens} prompt tokens are waiting; {seq.prompt_len} more would pass "
                             f"--max-waiting-tokens {self.config.max_waiting_tokens}")

    def discard(self, cache: CacheRequest) -> None:
        """Releases the kvcached lease of a request that will never be added."""
        with self._cond:
            self.prefix.discard(CacheState(cache))

    def abort(self, request_id: str) -> None:
        """Ends the request now and frees its pages; the final outputs (finish_reason "abort") of its unfinished
        samples are sent from here."""
        with self._cond:
            for seq in self.scheduler.remove(request_id):
                seq.finished = True
                self._emit(seq, [], "", "abort")

    def load(self) -> Load:
        with self._cond:
            return Load(len(self.scheduler.running), len(self.scheduler.waiting),
                        self.pool.num_pages - self.pool.num_free, self.pool.num_pages, self.prefix.cached_pages,
                        self.scheduler.admitted, self.scheduler.admitted_blocked)

    def check_integrity(self) -> None:
        """Pool and L1 index invariants; when no request is in flight, every held page is a cached one."""
        with self._cond:
            self.prefix.check_integrity()
            held = self.pool.num_pages - self.pool.num_free
            if not self.scheduler.has_work() and held != self.prefix.cached_pages:
                raise AssertionError(f"idle, yet {held} pages are held and {self.prefix.cached_pages} cached")

    # -- stepping ----------------------------------------------------------------------------------------------
    def step(self) -> bool:
        """Runs one forward over the next batch; False when there was nothing to run. One stepping thread only."""
        with self._cond:
            chunks = self.scheduler.schedule()
            if not chunks:
                return False
            inputs = self._prepare_inputs(chunks)
        try:
            logits = self.model(*inputs)
        except Exception:
            if len(chunks) == 1:
                raise
            log.exception("batched forward failed; running its requests one at a time",
                          extra={"requests": [c.seq.request_id for c in chunks]})
            for chunk in chunks:
                self._step_alone(chunk)
            return True
        with self._cond:
            self._process(chunks, logits)
        return True

    def _step_alone(self, chunk: ScheduledChunk) -> None:
        """Runs one request's chunk by itself (its pages are allocated); a failure ends that request alone."""
        with self._cond:
            if chunk.seq.finished:
                return
            inputs = self._prepare_inputs([chunk])
        try:
            logits = self.model(*inputs)
        except Exception as e:
            log.exception("forward failed for one request", extra={"request_id": chunk.seq.request_id})
            with self._cond:
                if not chunk.seq.finished:
                    self._fail(chunk.seq, f"the forward pass failed: {type(e).__name__}")
            return
        with self._cond:
            self._process([chunk], logits)

    def _prepare_inputs(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, ...]:
        now = time.perf_counter()
        ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        for chunk in chunks:
            seq, start = chunk.seq, chunk.start
            seq.scheduled_at = seq.scheduled_at or now
            known = seq.token_ids + seq.draft if _drafts(chunk) else seq.token_ids
            ids.extend(known[start:start + chunk.length])
            positions.extend(range(start, start + chunk.length))
            logits_rows.extend(range(len(ids) - _rows_of(chunk), len(ids)))
        meta = self.backend.prepare(
            [Chunk(self.pool.block_table(c.seq.key), c.start, c.length) for c in chunks])

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return tensor(ids), tensor(positions), meta, tensor(logits_rows)

    def _process(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> None:
        """Scores prompt chunks that ask for it, samples, and advances every chunk's sequence (logits rows: module
        docstring)."""
        sampling_chunks, sampling_rows, drafted, first = [], [], [], 0
        for chunk in chunks:
            n = _rows_of(chunk)
            if _scores_prompt(chunk) and n > chunk.samples and not chunk.seq.finished:
                self._score_prompt(chunk, logits[first:first + n - chunk.samples])
            if _drafts(chunk):
                drafted.append((chunk, logits[first:first + n]))
            elif chunk.samples:
                sampling_chunks.append(chunk)
                sampling_rows.append(first + n - 1)
            first += n
        for chunk in chunks:
            seq = chunk.seq
            if not seq.finished:
                seq.num_computed += chunk.length
                if chunk.start < seq.prompt_len <= seq.num_computed:  # prefill done: cache the prompt's pages
                    self.prefix.cache(seq.key, seq.token_ids, seq.num_computed, seq.cache)
        for chunk, row in list(zip(sampling_chunks, sampling_rows)):
            if chunk.seq.forks and not chunk.seq.finished:  # the other samples start from the same row
                forked = self._fork(chunk.seq)
                sampling_chunks.extend(chunk._replace(seq=sample) for sample in forked)
                sampling_rows.extend([row] * len(forked))
        if sampling_rows != list(range(len(logits))):
            logits = logits[sampling_rows]
        tokens, logprobs = self._sample(sampling_chunks, logits) if sampling_chunks else ([], [])
        for chunk, token, logprob in zip(sampling_chunks, tokens, logprobs):
            if not chunk.seq.finished and self._take(chunk.seq, token, logprob):
                self._propose(chunk.seq)
        for chunk, rows in drafted:
            if not chunk.seq.finished:
                self._verify(chunk, rows)

    def _take(self, seq: Sequence, token: int | None, logprob: TokenLogprob | None) -> bool:
        """Appends a sampled token once its grammar accepts it; a token that could not be sampled (None: the logits
        are not finite) or that the grammar refuses fails `seq` instead. Whether it was taken."""
        if token is None:
            self._fail(seq, "sampling failed: the logits are not finite")
            return False
        if seq.matcher is not None and not seq.matcher.accept_token(token):
            self._fail(seq, f"the grammar refused token {token}, which its mask allowed")
            return False
        self._append_token(seq, token, logprob)
        return True

    def _propose(self, seq: Sequence) -> None:
        """The draft the next decode of greedy `seq` verifies in the same forward (`_verify`), within the pages
        reserved for the sequence: for a constrained sequence the tokens of the string its grammar forces next
        (jump-forward); for another, up to `speculative_tokens` looked up in its own text (`NgramDrafter`), fewer
        when many run (a step's decode rows stay within `DRAFT_ROWS`)."""
        if seq.generator is not None or seq.finished:
            return
        room = seq.max_tokens - 1 - len(seq.token_ids)
        if seq.matcher is not None:
            forced = None if self.config.disable_jump_forward else seq.matcher.find_jump_forward_string()
            if forced:
                seq.draft = self.tokenizer.encode(forced, add_special_tokens=False)[:room]
        elif self._speculative_tokens:
            wanted = min(self._speculative_tokens, room, DRAFT_ROWS // len(self.scheduler.running) - 1)
            seq.drafter = seq.drafter or NgramDrafter()
            seq.draft = seq.drafter.propose(seq.token_ids, wanted)

    def _verify(self, chunk: ScheduledChunk, logits: torch.Tensor) -> None:
        """Greedy decoding over a decode chunk with a draft: row j's masked argmax is the token after draft[:j], as
        one decode step would choose it. Draft tokens are taken while they agree; the first disagreeing choice, or
        the choice after the whole draft, is taken too, and decoding continues from there (its K/V is not yet
        computed)."""
        seq = chunk.seq
        draft, seq.draft = seq.draft, []
        raw = torch.log_softmax(logits, dim=-1) if seq.sampling.logprobs else None  # a copy: masking changes logits
        seq.num_computed = chunk.start + 1
        # a constrained row's mask depends on the tokens taken before it; unconstrained rows are chosen at once
        choices = None if seq.matcher is not None else sample(logits, [GREEDY_ROW] * len(logits))
        for j in range(len(draft) + 1):
            if choices is not None:
                token = choices[j]
            else:
                (token,) = sample(logits[j:j + 1], [GREEDY_ROW],
                                  lambda masked: self._mask.apply(masked, [(0, seq.matcher)]))
            logprob = (None if raw is None or token is None
                       else token_logprobs(raw[j:j + 1], [token], [seq.sampling.top_logprobs])[0])
            if not self._take(seq, token, logprob):
                return
            if seq.finished or j == len(draft) or token != draft[j]:
                break
            seq.num_computed += 1
        self._propose(seq)

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """The other samples of `seq`'s request, now that its prefill is done (module docstring); they run from
        the next step on. Their pages were reserved at admission."""
        samples = []
        for index in range(1, seq.forks + 1):
            sampling = seq.sampling
            seed = None if sampling.seed is None else (sampling.seed + index) % 2**64
            sample = dataclasses.replace(
                seq, token_ids=list(seq.token_ids), index=index, forks=0, prompt_logprobs=[], draft=[], drafter=None,
                generator=make_generator(seed, self.device) if seq.generator is not None else None,
                detokenizer=IncrementalDetokenizer(self.tokenizer), stop_filter=StopStringFilter(sampling.stop),
                cache=self.prefix.fork(seq.cache),
                matcher=new_matcher(seq.grammar) if seq.grammar is not None else None)
            self.prefix.make_room(1)
            self.pool.fork(seq.key, sample.key, seq.num_computed)
            self.scheduler.running.append(sample)
            samples.append(sample)
        seq.forks = 0
        return samples

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor
                ) -> tuple[list[int | None], list[TokenLogprob | None]]:
        """One token per row of `logits` (one row per chunk), masked by each constrained chunk's grammar; and its
        logprob where asked. Modifies `logits`."""
        rows = [SamplingRow(c.seq.sampling.temperature, c.seq.sampling.top_k, c.seq.sampling.top_p,
                            c.seq.generator) for c in chunks]
        asking = [i for i, c in enumerate(chunks) if c.seq.sampling.logprobs]
        raw = torch.log_softmax(logits[asking], dim=-1) if asking else None  # a copy: the mask changes `logits`
        constrained = [(i, c.seq.matcher) for i, c in enumerate(chunks) if c.seq.matcher is not None]
        tokens = sample(logits, rows, (lambda masked: self._mask.apply(masked, constrained)) if constrained else None)
        logprobs: list[TokenLogprob | None] = [None] * len(chunks)
        known = [i for i in asking if tokens[i] is not None]
        if known:
            found = token_logprobs(raw[[asking.index(i) for i in known]], [tokens[i] for i in known],
                                   [chunks[i].seq.sampling.top_logprobs for i in known])
            for i, logprob in zip(known, found):
                logprobs[i] = logprob
        return tokens, logprobs

    def _score_prompt(self, chunk: ScheduledChunk, logits: torch.Tensor) -> None:
        """Appends the logprobs of the prompt tokens start+1 .. start+len(logits) from `prompt_logprobs_start` on to
        the sequence; a row that is not finite fails the request."""
        seq = chunk.seq
        skip = max(0, seq.sampling.prompt_logprobs_start - 1 - chunk.start)
        logits = logits[skip:]
        if not torch.isfinite(logits).all():
            self._fail(seq, "prompt scoring failed: the logits are not finite")
            return
        first = chunk.start + 1 + skip
        scored = seq.token_ids[first:first + len(logits)]
        seq.prompt_logprobs.extend(token_logprobs(torch.log_softmax(logits, dim=-1), scored,
                                                  [seq.sampling.top_logprobs] * len(scored)))

    def _fail(self, seq: Sequence, error: str) -> None:
        """Ends `seq` alone: its pages are freed and its last output says why (finish_reason "error")."""
        log.error("request failed", extra={"request_id": seq.request_id, "error": error})
        self.scheduler.finish(seq)
        self._emit(seq, [], "", "error", error)

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        seq.token_ids.append(token)
        seq.first_token_at = seq.first_token_at or time.perf_counter()
        text, hit_stop = "", False
        if not self._is_eos(seq, token):
            text, hit_stop = seq.stop_filter.push(seq.detokenizer.add(token))
        finish = "stop" if hit_stop or self._is_eos(seq, token) else None
        if finish is None and len(seq.token_ids) >= seq.max_tokens:
            finish = "length"
        if finish is not None and not hit_stop:
            text += seq.stop_filter.push(seq.detokenizer.flush())[0] + seq.stop_filter.flush()
        if finish is not None:
            self.scheduler.finish(seq)
        self._emit(seq, [token], text, finish, logprobs=() if logprob is None else (logprob,))

    def _is_eos(self, seq: Sequence, token: int) -> bool:
        return (token in self._eos and not seq.sampling.ignore_eos) or token in seq.sampling.stop_token_ids

    def _emit(self, seq: Sequence, tokens: list[int], text: str, finish: str | None, error: str | None = None,
              logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        first = bool(tokens) and seq.num_output == 1
        timed = finish is not None or first
        output = RequestOutput(seq.request_id, tuple(tokens), text, finish, error=error, logprobs=logprobs,
                               prompt_logprobs=tuple(seq.prompt_logprobs) if first else (), index=seq.index)
        if timed:
            started = seq.scheduled_at or time.perf_counter()
            output = dataclasses.replace(
                output, queue_ms=(started - seq.arrival) * 1e3,
                prefill_ms=((seq.first_token_at or started) - started) * 1e3,
                cached_tokens_l1=seq.cache.cached_l1_tokens, cached_tokens_l2=seq.cache.cached_l2_tokens,
                l2_copy_ms=seq.cache.l2_copy_ms)
        # samples never forked end with the one they were to fork from
        unforked = [RequestOutput(seq.request_id, (), "", finish, error=error, index=seq.index + i)
                    for i in range(1, seq.forks + 1)] if finish is not None else []
        try:
            for each in (output, *unforked):
                seq.on_output(each)
        except Exception:  # a broken callback must not take the other requests down with it
            log.exception("on_output failed", extra={"request_id": seq.request_id})

    # -- background loop ---------------------------------------------------------------------------------------
    def start(self, on_death: Callable[[], None] = lambda: None) -> None:
        """Runs the step loop on a daemon thread until `stop()`; `on_death` runs on that thread if the loop dies."""
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._stopping = False
        release_openmp_threads()  # the step thread's forwards get the cores (see there)
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._loop, args=(on_death,), name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the loop after the current step; queued requests stay queued, queued commits are sent."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.kvcache is not None:
            self.kvcache.close()

    def _loop(self, on_death: Callable[[], None]) -> None:
        try:
            self._run_loop()
        except BaseException:
            log.critical("the engine loop died; no request can run", exc_info=True)
            self.dead = True
            on_death()

    def _run_loop(self) -> None:
        while True:
            with self._cond:
                if not self.scheduler.has_work():
                    self._cond.wait_for(lambda: self._stopping or self.scheduler.has_work())
                self._await_returning_requests()
                if self._stopping:
                    return
            try:
                if not self.step():
                    with self._cond:
                        self._cond.wait(0.01)
            except Exception:
                log.exception("engine step failed; aborting the running requests")
                self._abort_running()

    def _await_returning_requests(self) -> None:
        """The arrival window: when nothing runs, waits up to `arrival_window_ms` before a step, until as many
        requests wait as the most a step ran with in the last second (`Scheduler.recent_peak`) when that was two or
        more; otherwise the whole window, or until a full batch (`max_running_requests`) waits (a burst after an idle
        second, or after a lone request such as a warm-up: nothing tells its size). A closed-loop client sends its
        next request when one ends, and requests sent together reach the worker a few milliseconds apart (4 sent at
        once: 11 ms from first to last, through the router, gaps up to 6 ms); admitted together, a round prefills in
        one step and decodes in lock step, instead of one request prefilling while the others' decodes wait behind
        it, round after round. (Stopping at two after the quick suite's warm-up request, its first no-reuse round
        started with 2 of 4, and those 2 decoded beside the others' prefill: 131 ms between their tokens against
        57.) No decode waits: nothing runs. A lone request waits the whole window, unless it is a cache hit.

        Without a recent peak of two or more, hits do not wait: when every waiting request has more of its prompt
        cached than left to compute (`PrefixCache.cached_tokens`), its prefill is short and the window would be a
        large part of its time to first token (a restarted kvcached's L3 hit of 112 new tokens over 1,888: TTFT
        153-166 ms with the window, 134-137 without). A closed loop's hits still wait for their round: admitted as
        they came, the second of each pair in the shared-prefix workload took up to 152 ms instead of 68."""
        if not self.config.arrival_window_ms or self.scheduler.running:
            return
        waiting = self.scheduler.waiting
        peak = self.scheduler.recent_peak()
        if peak < 2 and all(2 * self.prefix.cached_tokens(seq.reusable, seq.cache) > seq.prompt_len
                            for seq in waiting):
            return
        expected = peak if peak >= 2 else self.scheduler.max_running  # a full batch needs no more waiting
        self._cond.wait_for(lambda: self._stopping or len(waiting) >= expected, self.config.arrival_window_ms / 1e3)

    def _abort_running(self) -> None:
        with self._cond:
            for seq in list(self.scheduler.running):
                self.abort(seq.request_id)

    # -- convenience -------------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
        """Runs `prompts` together to completion; the generated token ids of each (eos included when hit), and of
        each sample in turn when `sampling.n` > 1. No prompts: none."""
        if not prompts:
            return []
        results: dict[tuple[str, int], list[int]] = {}
        done = threading.Event()
        remaining = [len(prompts) * sampling.n]

        def collect(output: RequestOutput) -> None:
            results.setdefault((output.request_id, output.index), []).extend(output.token_ids)
            if output.finish_reason is not None:
                remaining[0] -= 1
                if remaining[0] == 0:
                    done.set()

        request_ids = [f"generate-{uuid.uuid4().hex}" for _ in prompts]
        grammar = self.grammars.compile(sampling.constraint) if sampling.constraint else None
        for request_id, prompt in zip(request_ids, prompts):
            self.add_request(request_id, prompt, sampling, collect, grammar=grammar)
        while not done.is_set():
            if self._thread is not None:
                done.wait()
            elif not self.step():
                raise RuntimeError("engine idle with unfinished requests")
        return [results.get((request_id, index), []) for request_id in request_ids for index in range(sampling.n)]
