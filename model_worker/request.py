"""What a request asks of the engine (`SamplingParams`, with its optional `Constraint`) and what it gets back
(`RequestOutput`, with `TokenLogprob`s when asked)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's and vLLM's default bound)


class ConstraintKind(str, Enum):
    REGEX = "regex"
    JSON_SCHEMA = "json_schema"  # the schema as JSON text
    GRAMMAR = "grammar"  # EBNF in xgrammar's (GBNF-like) dialect, rule `root` first
    CHOICES = "choices"  # exactly one of a list of strings


@dataclass(frozen=True)
class Constraint:
    """What the output must match: `spec` is the text of a regex, schema or grammar, or the tuple of choices.
    Hashable: compiled grammars are cached by it."""

    kind: ConstraintKind
    spec: str | tuple[str, ...]


@dataclass(frozen=True)
class TokenLogprob:
    """A token and its logprob under the model's raw distribution (before temperature, top-k/p and any grammar
    mask), with the `top` most likely tokens at that position, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; temperature 0 is greedy, top_k 0 and top_p 1.0 are off, seed None is random."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    constraint: Constraint | None = None
    logprobs: bool = False  # report each generated token's logprob
    top_logprobs: int = 0  # and this many alternatives (for prompt tokens too)
    prompt_logprobs: bool = False  # score the prompt's tokens from `prompt_logprobs_start` on
    prompt_logprobs_start: int = 1  # the prefix before it may come from the cache (a cached page has no logits)
    n: int = 1  # samples of the prompt: one prefill, whose pages they share (`model_worker.engine`)
    stop_token_ids: tuple[int, ...] = ()  # end the sample (finish "stop") like EOS, even with ignore_eos

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < float("inf"):  # also refuses NaN, which compares false with everything
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.prompt_logprobs_start < 1:
            raise ValueError(f"prompt_logprobs_start must be >= 1, got {self.prompt_logprobs_start}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.constraint is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a constraint: the grammar decides where output ends")


@dataclass(frozen=True)
class RequestOutput:
    """One step's news for one sample of a request: new token ids and text delta; timings on the first and final
    outputs. Each of a request's `n` samples ends with its own final output."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # None | "stop" | "length" | "abort" | "error" (then `error` says why)
    queue_ms: float | None = None
    prefill_ms: float | None = None
    cached_tokens_l1: int | None = None  # prompt tokens reused from the worker's own pool
    cached_tokens_l2: int | None = None  # prompt tokens copied out of kvcached's shared memory
    l2_copy_ms: float | None = None  # of `queue_ms`, the copy of those tokens into the worker's pool
    error: str | None = None  # with finish_reason "error": what failed for this request alone
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked for logprobs
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # on sample 0's first token: prompt tokens 1..n-1, in order
    index: int = 0  # which sample, in [0, n)
