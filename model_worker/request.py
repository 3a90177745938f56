"""What a request asks of the engine (`SamplingParams`) and what it gets back (`RequestOutput`)."""

from __future__ import annotations

from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < float("inf"):  # also refuses NaN, which compares false with everything
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class RequestOutput:
    """One step's news for a request: new token ids and text delta; timings on the first and final outputs."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # None | "stop" | "length" | "abort" | "error" (then `error` says why)
    queue_ms: float | None = None
    prefill_ms: float | None = None
    cached_tokens_l1: int | None = None  # prompt tokens reused from the worker's own pool
    cached_tokens_l2: int | None = None  # prompt tokens copied out of kvcached's shared memory
    error: str | None = None  # with finish_reason "error": what failed for this request alone
