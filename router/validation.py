"""Checks a GenerateRequest and resolves its defaults. Every failure is INVALID_ARGUMENT naming the field.

Order matters for cost: cheap structural checks and the character limit come before tokenization.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from radixserve.server import invalid
from radixserve.v1 import router_pb2, worker_pb2
from router.tokenizer import CHAT_ROLES, PromptTokenizer

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int
    max_new_tokens: int
    max_input_chars: int
    max_stop_strings: int


def prompt_ids(request: router_pb2.GenerateRequest | router_pb2.TokenizeRequest, tokenizer: PromptTokenizer,
               limits: Limits) -> list[int]:
    """The prompt's token ids from exactly one of text, messages, token_ids."""
    token_ids = list(getattr(request, "token_ids", ()))
    given = [name for name, present in (("text", request.HasField("text")), ("messages", bool(request.messages)),
                                        ("token_ids", bool(token_ids))) if present]
    if len(given) != 1:
        allowed = "text, messages, token_ids" if hasattr(request, "token_ids") else "text, messages"
        raise invalid(f"exactly one of {allowed} must be set; got {', '.join(given) or 'none'}")
    if given == ["token_ids"]:
        return _checked_token_ids(token_ids, limits.vocab_size)
    if given == ["text"]:
        _check_chars("text", len(request.text), limits)
        if not request.text:
            raise invalid("text must not be empty")
        return tokenizer.encode_text(request.text)
    return tokenizer.encode_chat(_checked_messages(request.messages, limits))


def _check_chars(field: str, n: int, limits: Limits) -> None:
    if n > limits.max_input_chars:
        raise invalid(f"{field} is {n} characters; the limit is {limits.max_input_chars}")


def _checked_token_ids(ids: list[int], vocab_size: int) -> list[int]:
    for i, t in enumerate(ids):
        if t >= vocab_size:
            raise invalid(f"token_ids[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
    return ids


def _checked_messages(messages, limits: Limits) -> list[tuple[str, str]]:
    _check_chars("messages", sum(len(m.content) for m in messages), limits)
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role {m.role!r} is not one of {', '.join(sorted(CHAT_ROLES))}")
    return [(m.role, m.content) for m in messages]


def resolve_sampling(sampling: router_pb2.SamplingParams, prompt_len: int, limits: Limits
                     ) -> worker_pb2.ResolvedSampling:
    """Fills unset fields with the documented defaults and checks every value against the limits."""
    temperature = sampling.temperature if sampling.HasField("temperature") else DEFAULT_TEMPERATURE
    top_p = sampling.top_p if sampling.HasField("top_p") else DEFAULT_TOP_P
    max_new = sampling.max_new_tokens if sampling.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS
    if not math.isfinite(temperature) or temperature < 0:
        raise invalid(f"sampling.temperature must be a finite number >= 0, not {temperature}")
    if not (0 < top_p <= 1):
        raise invalid(f"sampling.top_p must be in (0, 1], not {top_p}")
    if not (1 <= max_new <= limits.max_new_tokens):
        raise invalid(f"sampling.max_new_tokens must be in [1, {limits.max_new_tokens}], not {max_new}")
    if prompt_len + max_new > limits.max_context:
        raise invalid(f"prompt ({prompt_len} tokens) + sampling.max_new_tokens ({max_new}) exceeds the model "
                      f"context of {limits.max_context} tokens")
    _check_stop(list(sampling.stop), limits)
    return worker_pb2.ResolvedSampling(
        temperature=temperature, top_p=top_p, top_k=sampling.top_k, max_new_tokens=max_new, stop=sampling.stop,
        seed=sampling.seed if sampling.HasField("seed") else None, ignore_eos=sampling.ignore_eos)


def _check_stop(stop: list[str], limits: Limits) -> None:
    if len(stop) > limits.max_stop_strings:
        raise invalid(f"sampling.stop has {len(stop)} strings; the limit is {limits.max_stop_strings}")
    if any(not s for s in stop):
        raise invalid("sampling.stop strings must not be empty")
