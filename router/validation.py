"""Checks a GenerateRequest and resolves its defaults. Every failure is INVALID_ARGUMENT naming the field and the
limit; a value echoed in a message is cut to `ECHO_CHARS`.

Order matters for cost: every limit is checked before the work it bounds. `prompt_ids` checks the identifiers,
the number of token ids (before they are copied or walked), of messages and of characters (before the chat template
and the tokenizer); `resolve_sampling` needs the prompt's length, so it runs after. Invalid UTF-8 never gets here:
protobuf refuses it when the request is parsed, and the server answers INVALID_ARGUMENT
(`radixserve.server.StatusInterceptor`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from radixserve.server import invalid
from radixserve.v1 import router_pb2, worker_pb2
from router.tokenizer import CHAT_ROLES, PromptTokenizer

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_MAX_NEW_TOKENS = 128
# Below this a temperature is greedy (resolved to 0): dividing logits by it overflows float32 to inf, and softmax to
# NaN. The worker's sampler and vLLM use the same threshold; clients send 1e-9 and the like to mean "deterministic".
GREEDY_BELOW = 1e-5
MAX_ID_CHARS = 256  # cache_salt and request_id: identifiers (a tenant, a trace id), logged and kept per request
MAX_TOP_LOGPROBS = 20  # alternatives per token: OpenAI's and vLLM's bound (the worker's own limit too)
MAX_CONSTRAINT_CHARS = 65_536  # a regex, schema or grammar, or all choices together: compiling is bounded by it
MAX_CHOICES = 256
CONSTRAINTS = ("regex", "json_schema", "grammar", "choices")
MAX_SAMPLES = 64  # sampling.n; a worker also refuses more than it runs at once (--max-running-requests)
MAX_STOP_TOKEN_IDS = 64
ECHO_CHARS = 40  # of a refused value quoted back in the message


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int
    max_new_tokens: int
    max_input_chars: int
    max_stop_strings: int
    max_stop_chars: int = 512  # RouterConfig's defaults
    max_messages: int = 1024


def prompt_ids(request: router_pb2.GenerateRequest | router_pb2.TokenizeRequest, tokenizer: PromptTokenizer,
               limits: Limits) -> list[int]:
    """The prompt's token ids from exactly one of text, messages, token_ids, after the request's identifiers and
    every input limit have been checked."""
    n_ids = len(getattr(request, "token_ids", ()))
    given = [name for name, present in (("text", request.HasField("text")), ("messages", bool(request.messages)),
                                        ("token_ids", n_ids > 0)) if present]
    if len(given) != 1:
        allowed = "text, messages, token_ids" if hasattr(request, "token_ids") else "text, messages"
        raise invalid(f"exactly one of {allowed} must be set; got {', '.join(given) or 'none'}")
    if isinstance(request, router_pb2.GenerateRequest):
        _check_ids(request)
    if given == ["token_ids"]:
        if n_ids > limits.max_context:
            raise invalid(f"token_ids has {n_ids} ids; the limit is the model context of {limits.max_context}")
        return _checked_token_ids(list(request.token_ids), limits.vocab_size)
    if given == ["text"]:
        _check_chars("text", len(request.text), limits)
        if not request.text:
            raise invalid("text must not be empty")
        return tokenizer.encode_text(request.text)
    return tokenizer.encode_chat(_checked_messages(request.messages, limits))


def _check_ids(request: router_pb2.GenerateRequest) -> None:
    for field in ("cache_salt", "request_id"):
        n = len(getattr(request, field))
        if n > MAX_ID_CHARS:
            raise invalid(f"{field} is {n} characters; the limit is {MAX_ID_CHARS}")


def _check_chars(field: str, n: int, limits: Limits) -> None:
    if n > limits.max_input_chars:
        raise invalid(f"{field} is {n} characters; the limit is {limits.max_input_chars}")


def _checked_token_ids(ids: list[int], vocab_size: int) -> list[int]:
    if ids and max(ids) >= vocab_size:
        i, t = next((i, t) for i, t in enumerate(ids) if t >= vocab_size)
        raise invalid(f"token_ids[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
    return ids


def _checked_messages(messages, limits: Limits) -> list[tuple[str, str]]:
    if len(messages) > limits.max_messages:
        raise invalid(f"messages has {len(messages)} messages; the limit is {limits.max_messages}")
    _check_chars("messages", sum(len(m.content) for m in messages), limits)
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role {_echo(m.role)} is not one of {', '.join(sorted(CHAT_ROLES))}")
    return [(m.role, m.content) for m in messages]


def _echo(value: str) -> str:
    return repr(value) if len(value) <= ECHO_CHARS else f"{value[:ECHO_CHARS]!r}... ({len(value)} characters)"


def resolve_sampling(sampling: router_pb2.SamplingParams, prompt_len: int, limits: Limits
                     ) -> worker_pb2.ResolvedSampling:
    """Fills unset fields with the documented defaults and checks every value against the limits; a temperature
    below `GREEDY_BELOW` resolves to 0 (greedy)."""
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
    _check_stop(sampling.stop, limits)
    n = sampling.n if sampling.HasField("n") else 1
    if not 1 <= n <= MAX_SAMPLES:
        raise invalid(f"sampling.n must be in [1, {MAX_SAMPLES}], not {n}")
    _check_stop_token_ids(sampling.stop_token_ids, limits)
    constraint = _checked_constraint(sampling)
    if constraint and sampling.ignore_eos:
        raise invalid(f"sampling.ignore_eos cannot be combined with sampling.{constraint}: the constraint decides "
                      "where the output ends")
    _check_logprobs(sampling)
    return worker_pb2.ResolvedSampling(
        temperature=temperature if temperature >= GREEDY_BELOW else 0.0, top_p=top_p, top_k=sampling.top_k,
        max_new_tokens=max_new, stop=sampling.stop, seed=sampling.seed if sampling.HasField("seed") else None,
        ignore_eos=sampling.ignore_eos,
        regex=sampling.regex if sampling.HasField("regex") else None,
        json_schema=sampling.json_schema if sampling.HasField("json_schema") else None,
        grammar=sampling.grammar if sampling.HasField("grammar") else None, choices=sampling.choices,
        logprobs=sampling.logprobs, top_logprobs=sampling.top_logprobs, prompt_logprobs=sampling.prompt_logprobs,
        n=n, stop_token_ids=sampling.stop_token_ids,
        prompt_logprobs_start=_prompt_logprobs_start(sampling, prompt_len))


def _checked_constraint(sampling: router_pb2.SamplingParams) -> str | None:
    """The name of the one constraint set (None: unconstrained), after its size limits; whether it compiles is the
    worker's to say."""
    given = [name for name in CONSTRAINTS[:3] if sampling.HasField(name)] + (["choices"] if sampling.choices else [])
    if len(given) > 1:
        raise invalid(f"at most one of sampling.{', sampling.'.join(CONSTRAINTS)} may be set; got {', '.join(given)}")
    if not given:
        return None
    (name,) = given
    texts = list(sampling.choices) if name == "choices" else [getattr(sampling, name)]
    if len(texts) > MAX_CHOICES:
        raise invalid(f"sampling.choices has {len(texts)} strings; the limit is {MAX_CHOICES}")
    if not all(texts):
        raise invalid(f"sampling.{name} must not be empty" if name != "choices" else
                      "sampling.choices strings must not be empty")
    chars = sum(map(len, texts))
    if chars > MAX_CONSTRAINT_CHARS:
        raise invalid(f"sampling.{name} is {chars} characters; the limit is {MAX_CONSTRAINT_CHARS}")
    return name


def _check_logprobs(sampling: router_pb2.SamplingParams) -> None:
    if sampling.top_logprobs > MAX_TOP_LOGPROBS:
        raise invalid(f"sampling.top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], not {sampling.top_logprobs}")
    if sampling.top_logprobs and not (sampling.logprobs or sampling.prompt_logprobs):
        raise invalid("sampling.top_logprobs needs sampling.logprobs or sampling.prompt_logprobs")


def _check_stop(stop: Sequence[str], limits: Limits) -> None:
    if len(stop) > limits.max_stop_strings:
        raise invalid(f"sampling.stop has {len(stop)} strings; the limit is {limits.max_stop_strings}")
    for i, s in enumerate(stop):
        if not s:
            raise invalid("sampling.stop strings must not be empty")
        if len(s) > limits.max_stop_chars:
            raise invalid(f"sampling.stop[{i}] is {len(s)} characters; the limit is {limits.max_stop_chars}")


def _check_stop_token_ids(ids: Sequence[int], limits: Limits) -> None:
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"sampling.stop_token_ids has {len(ids)} ids; the limit is {MAX_STOP_TOKEN_IDS}")
    if ids and max(ids) >= limits.vocab_size:
        raise invalid(f"sampling.stop_token_ids must be in [0, {limits.vocab_size}), not {max(ids)}")


def _prompt_logprobs_start(sampling: router_pb2.SamplingParams, prompt_len: int) -> int:
    if not sampling.HasField("prompt_logprobs_start"):
        return 1
    if not sampling.prompt_logprobs:
        raise invalid("sampling.prompt_logprobs_start needs sampling.prompt_logprobs")
    start = sampling.prompt_logprobs_start
    if not 1 <= start < prompt_len:
        raise invalid(f"sampling.prompt_logprobs_start must be in [1, {prompt_len - 1}] for this prompt of "
                      f"{prompt_len} tokens, not {start}")
    return start
