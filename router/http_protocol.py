"""JSON <-> the router's messages for the HTTP API: OpenAI's chat and text completions, and SGLang's native /generate.

Pure: no I/O. A `parse_*` function turns a request body into a `Call`: the `GenerateRequest` that the router's own
path (`router.service.Router.generate`) runs, exactly as it runs one from gRPC, and the `Answer` that renders its
responses in that API's shape. A parser checks only what JSON adds: that the body is an object, each field's type
and that integers fit their proto fields. Every value the router checks (the prompt, ranges, limits) is left to its
validation, so HTTP and gRPC refuse the same requests with the same messages.

Fields the engine cannot honour yet (penalties, tools, ...) are in one table per API,
`*_NOT_YET`: null or a value that asks for nothing passes, anything else is a 400 `unsupported_parameter` naming the
field. Supporting one is deleting its row and translating it in the parser. Any other field is ignored, as vLLM and
SGLang do: clients send their own defaults of fields we have never heard of.

Constraints (`response_format`, vLLM's `guided_*`, SGLang's `json_schema`/`regex`/`ebnf`) map to the router's one
constraint per request; two at once are a 400 naming the HTTP fields. Logprobs render in each API's shape from the
responses' `logprobs` (every generated token, the end-of-sequence token that ends the output too, as vLLM does) and
each token's text and bytes (`TokenStrings`, which the server looks up for `logprob_token_ids`).

Errors are `HttpError`s; `http_error` maps the router's `ServiceError`s (gRPC statuses) to HTTP, with the fields
its message names renamed to the API's (`FieldNames`). Their body is OpenAI's
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from radixserve.server import ServiceError
from radixserve.v1 import router_pb2
from router.validation import ECHO_CHARS

UINT32 = 2**32
UINT64 = 2**64

# A token id's text alone and its bytes (`router.service.Router.token_strings`).
TokenStrings = Mapping[int, tuple[str, bytes]]

# The router's statuses as HTTP statuses, and the code in the error body; any other (INTERNAL) is 500. A CANCELLED
# that reaches a client came from a worker (say, draining): the client did not cancel, so it is "try again".
_FROM_GRPC = {grpc.StatusCode.INVALID_ARGUMENT: (400, None),
              grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_exceeded"),
              grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
              grpc.StatusCode.CANCELLED: (503, "service_unavailable"),
              grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
              grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_api_key")}


class HttpError(Exception):
    """An answer other than 200: the HTTP status, and OpenAI's error body (`body()`). `retry_after_s` goes to the
    `Retry-After` header."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        kind = ("rate_limit_error" if self.status == 429 else "server_error" if self.status >= 500
                else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class FieldNames:
    """The router's field names (`sampling.max_new_tokens`) as one API calls them (`max_tokens`), so that an error
    message and its `param` name what the client sent."""

    def __init__(self, names: Mapping[str, str]):
        self._names = dict(names)
        longest_first = sorted(names, key=len, reverse=True)
        # A name is a whole word: "text" is renamed, "context" is not; "sampling.stop" is, in "sampling.stop[0]" too.
        self._pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, longest_first)) + r")(?!\w)")

    def adding(self, names: Mapping[str, str]) -> FieldNames:
        """These names and `names` (say, the one HTTP field a request set its constraint with)."""
        return FieldNames({**self._names, **names}) if names else self

    def translate(self, message: str) -> tuple[str, str | None]:
        """The message in the API's names, and the first field it names (None: none)."""
        if not self._names:
            return message, None
        first = self._pattern.search(message)
        return (self._pattern.sub(lambda m: self._names[m[1]], message),
                self._names[first[1]] if first else None)


def http_error(error: ServiceError, names: FieldNames) -> HttpError:
    """The router's failure as HTTP: 400 bad input, 429 overload (with its retry delay), 503 no worker, 504 past the
    deadline, 500 anything else."""
    status, code = _FROM_GRPC.get(error.code, (500, None))
    message, param = names.translate(error.message)
    return HttpError(status, message, param, code, error.retry_after_s)


def invalid(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, param)


def parse_json(body: bytes) -> Any:
    """The decoded body; 400 when it is not JSON (or not UTF-8, or nested too deep, or uses NaN or Infinity, which
    JSON does not have)."""
    try:
        return json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise invalid(f"the body is not valid JSON: {str(e)[:200] or type(e).__name__}") from None


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def parse_request_id(header: str | None) -> str:
    """The `X-Request-Id` header ("" when absent: the router makes one up); the router checks its length."""
    return "" if header is None else _string(header, "X-Request-Id")


def parse_timeout(header: str | None) -> float | None:
    """The `X-Request-Timeout` header, seconds (None when absent): how long the client waits, as a gRPC deadline."""
    if header is None:
        return None
    try:
        seconds = float(header)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise invalid(f"the X-Request-Timeout header must be a positive number of seconds, not {_echo(header)}",
                      "X-Request-Timeout")
    return seconds


class Answer(Protocol):
    """Renders one request's responses: `whole` the responses of an unstreamed request (one per sample, the last
    with usage), `events` each response of a streamed one (zero or more server-sent events; the server ends the
    stream with `[DONE]`). `strings` holds at least the responses' `logprob_token_ids`."""

    stream: bool

    def whole(self, responses: Sequence[router_pb2.GenerateResponse], strings: TokenStrings) -> dict: ...

    def events(self, response: router_pb2.GenerateResponse, strings: TokenStrings) -> list[dict]: ...


def logprob_token_ids(*responses: router_pb2.GenerateResponse) -> set[int]:
    """The tokens whose text rendering the responses' logprobs need: each chosen one and its alternatives."""
    return {t.token_id for response in responses for entry in response.logprobs for t in (entry, *entry.top)}


@dataclass(frozen=True)
class Call:
    request: router_pb2.GenerateRequest
    answer: Answer
    names: FieldNames  # for the router's errors about this request


NO_NAMES = FieldNames({})
_OPENAI_SAMPLING = {f"sampling.{name}": name
                    for name in ("temperature", "top_p", "top_k", "stop", "seed", "n", "stop_token_ids")}
CHAT_NAMES = FieldNames({**_OPENAI_SAMPLING, "sampling.max_new_tokens": "max_tokens", "request_id": "X-Request-Id",
                         "sampling.logprobs": "logprobs", "sampling.top_logprobs": "top_logprobs"})
COMPLETION_NAMES = FieldNames({**_OPENAI_SAMPLING, "sampling.max_new_tokens": "max_tokens", "text": "prompt",
                               "token_ids": "prompt", "request_id": "X-Request-Id",
                               "sampling.top_logprobs": "logprobs"})
_SGLANG_SAMPLING = {f"sampling.{name}": f"sampling_params.{name}"
                    for name in ("temperature", "top_p", "top_k", "stop", "max_new_tokens", "stop_token_ids")}
SGLANG_NAMES = FieldNames({**_SGLANG_SAMPLING, "sampling.seed": "sampling_params.sampling_seed",
                           "token_ids": "input_ids", "request_id": "rid", "sampling.logprobs": "return_logprob",
                           "sampling.top_logprobs": "top_logprobs_num"})


class _Fields:
    """A JSON object's fields, each read with its type checked; null reads as absent. `where` prefixes the names
    in messages ("sampling_params")."""

    def __init__(self, value: Any, where: str):
        if not isinstance(value, dict):
            raise invalid(f"{where or 'the body'} must be a JSON object, not {_json_type(value)}", where or None)
        self._fields = value
        self._where = where

    def name(self, field: str) -> str:
        return f"{self._where}.{field}" if self._where else field

    def raw(self, field: str) -> Any:
        return self._fields.get(field)

    def string(self, field: str) -> str | None:
        value = self.raw(field)
        return None if value is None else _string(value, self.name(field))

    def boolean(self, field: str) -> bool | None:
        return self._typed(field, bool, "a boolean")

    def number(self, field: str) -> float | None:
        value = self.raw(field)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid(f"{self.name(field)} must be a number, not {_json_type(value)}", self.name(field))
        try:
            return float(value)
        except OverflowError:  # an integer of thousands of digits (a float literal that large is already inf)
            raise invalid(f"{self.name(field)} is too large", self.name(field)) from None

    def integer(self, field: str, below: int) -> int | None:
        """An integer in [0, below): what the proto field can hold."""
        value = self.raw(field)
        return None if value is None else _integer(value, self.name(field), below)

    def token_ids(self, field: str) -> list[int]:
        """An array of token ids (say, `stop_token_ids`); empty when absent."""
        value = self.raw(field)
        if value is None:
            return []
        if not isinstance(value, list):
            raise invalid(f"{self.name(field)} must be an array of token ids, not {_json_type(value)}",
                          self.name(field))
        return _token_ids(value, self.name(field))

    def strings(self, field: str) -> list[str]:
        """A string or an array of strings (say, `stop`); empty when absent."""
        value = self.raw(field)
        if value is None:
            return []
        if isinstance(value, str):
            return [_string(value, self.name(field))]
        if not isinstance(value, list):
            raise invalid(f"{self.name(field)} must be a string or an array of strings, not {_json_type(value)}",
                          self.name(field))
        return [_string(s, f"{self.name(field)}[{i}]") for i, s in enumerate(value)]

    def nested(self, field: str) -> _Fields:
        """The object in `field`; an empty one when absent."""
        value = self.raw(field)
        return _Fields({} if value is None else value, self.name(field))

    def refuse_not_yet(self, table: Mapping[str, tuple]) -> None:
        """400 for every field of `table` that asks for something: not null and none of its no-op values."""
        for field, noops in table.items():
            value = self.raw(field)
            if value is not None and not any(type(value) is type(n) and value == n for n in noops):
                hint = f"leave it out or send {json.dumps(noops[0])}" if noops else "leave it out"
                raise HttpError(400, f"{self.name(field)} = {_cut(json.dumps(value))} is not supported yet: "
                                     f"{hint}", self.name(field), "unsupported_parameter")

    def _typed(self, field: str, kind: type, what: str):
        value = self.raw(field)
        if value is not None and not isinstance(value, kind):
            raise invalid(f"{self.name(field)} must be {what}, not {_json_type(value)}", self.name(field))
        return value


def _string(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise invalid(f"{name} must be a string, not {_json_type(value)}", name)
    try:
        value.encode()
    except UnicodeEncodeError:  # a lone surrogate ("\ud800"): valid JSON, not a Unicode string
        raise invalid(f"{name} is not valid Unicode (a lone surrogate)", name) from None
    return value


def _integer(value: Any, name: str, below: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name} must be an integer, not {_json_type(value)}", name)
    if not 0 <= value < below:
        raise invalid(f"{name} must be an integer in [0, {below - 1}], not {_cut(str(value))}", name)
    return value


def _token_ids(value: Any, name: str) -> list[int]:
    return [_integer(t, f"{name}[{i}]", UINT32) for i, t in enumerate(value)]


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _echo(value: str) -> str:
    return repr(value) if len(value) <= ECHO_CHARS else f"{value[:ECHO_CHARS]!r}... ({len(value)} characters)"


def _cut(value: str) -> str:
    return value if len(value) <= ECHO_CHARS else f"{value[:ECHO_CHARS]}... ({len(value)} characters)"


def _check_model(fields: _Fields, served: str) -> None:
    """`model` may be left out (the one served) or name it; anything else is 404 model_not_found."""
    model = fields.string("model")
    if model is not None and model != served:
        raise HttpError(404, f"the model {_echo(model)} does not exist; this server serves {served!r}", "model",
                        "model_not_found")


def _sampling(fields: _Fields, max_tokens: int | None, seed_field: str, **more: Any) -> router_pb2.SamplingParams:
    """The sampling fields every API shares (the seed under its own name; `n`, and vLLM's and SGLang's
    `stop_token_ids`), and `more` (each API's constraint and logprobs); unset stays unset (the router's
    defaults)."""
    off = fields.raw("top_k") == -1 and isinstance(fields.raw("top_k"), int)  # "off" in vLLM and SGLang
    return router_pb2.SamplingParams(
        temperature=fields.number("temperature"), top_p=fields.number("top_p"), max_new_tokens=max_tokens,
        top_k=None if off else fields.integer("top_k", UINT32), stop=fields.strings("stop"),
        seed=fields.integer(seed_field, UINT64), ignore_eos=fields.boolean("ignore_eos"),
        n=fields.integer("n", UINT32), stop_token_ids=fields.token_ids("stop_token_ids"), **more)


# A constraint as a request can set it: (the HTTP field, the router's SamplingParams field, the value; None: unset).
Constraint = tuple[str, str, Any]
JSON_OBJECT = '{"type": "object"}'  # response_format json_object: any JSON object


def _one_constraint(given: Sequence[Constraint], names: FieldNames) -> tuple[dict, FieldNames]:
    """The SamplingParams fields of the one constraint set among `given` (none: {}), and `names` with the router's
    name for it renamed to the HTTP field (its spec's compile errors name what the client sent); 400 for two."""
    chosen = [(field, target, value) for field, target, value in given if value is not None]
    if len(chosen) > 1:
        raise invalid(f"at most one of {', '.join(field for field, _, _ in given)} may be set; got "
                      f"{', '.join(field for field, _, _ in chosen)}", chosen[1][0])
    if not chosen:
        return {}, names
    field, target, value = chosen[0]
    return {target: value}, names.adding({f"sampling.{target}": field})


def _openai_constraints(fields: _Fields) -> list[Constraint]:
    """`response_format`, and vLLM's `guided_json` (a schema, as an object or JSON text), `guided_regex`,
    `guided_choice` and `guided_grammar`."""
    return [("response_format", "json_schema", _response_format(fields)),
            ("guided_json", "json_schema", _schema(fields, "guided_json")),
            ("guided_regex", "regex", fields.string("guided_regex")),
            ("guided_choice", "choices", fields.strings("guided_choice") or None),
            ("guided_grammar", "grammar", fields.string("guided_grammar"))]


def _response_format(fields: _Fields) -> str | None:
    """OpenAI's `response_format` as a JSON schema: `text` none, `json_object` any object, `json_schema` its
    `json_schema.schema` (`name` and `strict` change nothing: the output always matches)."""
    if fields.raw("response_format") is None:
        return None
    form = fields.nested("response_format")
    kind = form.string("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT
    if kind == "json_schema":
        spec = form.nested("json_schema")
        if spec.raw("schema") is None:
            raise invalid(f"{spec.name('schema')} is required", spec.name("schema"))
        return _schema(spec, "schema")
    raise invalid(f"{form.name('type')} must be one of text, json_object, json_schema, not "
                  f"{_cut(json.dumps(kind))}", form.name("type"))


def _schema(fields: _Fields, field: str) -> str | None:
    """A JSON schema given as an object or as JSON text, as JSON text."""
    value = fields.raw(field)
    if value is None or isinstance(value, str):
        return fields.string(field)
    if not isinstance(value, dict):
        raise invalid(f"{fields.name(field)} must be a JSON schema (an object) or its JSON text, not "
                      f"{_json_type(value)}", fields.name(field))
    return json.dumps(value)


def _openai_common(fields: _Fields, served: str) -> tuple[str, bool, bool]:
    """The cache salt (`cache_salt` as vLLM names it, else `user`: one tenant's cached prefixes are never
    another's), `stream` and `stream_options.include_usage`, after the model check."""
    _check_model(fields, served)
    salt = fields.string("cache_salt")
    options = fields.nested("stream_options")
    if salt is None:
        salt = fields.string("user") or ""
    return salt, bool(fields.boolean("stream")), bool(options.boolean("include_usage"))


# Fields OpenAI defines that the engine cannot honour yet, with the values that ask for nothing (see the module
# docstring). Penalties and logit_bias are sampling features the worker lacks; tools need a parser of tool calls.
_PENALTIES = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},)}
CHAT_NOT_YET = {"tools": ([],), "functions": ([],), **_PENALTIES}
COMPLETION_NOT_YET = {"best_of": (1,), "echo": (False,), "suffix": ("",), **_PENALTIES}
SGLANG_NOT_YET = {"image_data": (), "input_embeds": (), "lora_path": ()}
SGLANG_SAMPLING_NOT_YET = {"n": (1,), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0),
                           "repetition_penalty": (1, 1.0), "min_new_tokens": (0,), "min_p": (0, 0.0),
                           "structural_tag": ()}


def parse_chat(body: Any, served: str, created: int) -> Call:
    """`POST /v1/chat/completions`: messages with the chat template (string content, or an array of text parts)."""
    fields = _Fields(body, "")
    fields.refuse_not_yet(CHAT_NOT_YET)
    salt, stream, include_usage = _openai_common(fields, served)
    max_tokens = fields.integer("max_completion_tokens", UINT32)
    if max_tokens is None:
        max_tokens = fields.integer("max_tokens", UINT32)
    constraint, names = _one_constraint(_openai_constraints(fields), CHAT_NAMES)
    logprobs = fields.boolean("logprobs")
    sampling = _sampling(fields, max_tokens, "seed", logprobs=logprobs,
                         top_logprobs=fields.integer("top_logprobs", UINT32), **constraint)
    request = router_pb2.GenerateRequest(messages=_messages(fields.raw("messages")), stream=stream, cache_salt=salt,
                                         sampling=sampling)
    return Call(request, OpenAIAnswer(served, created, stream, include_usage, chat=True, logprobs=bool(logprobs)),
                names)


def _messages(value: Any) -> list[router_pb2.ChatMessage]:
    if not isinstance(value, list) or not value:
        raise invalid(f"messages must be a non-empty array, not {_json_type(value)}", "messages")
    messages = []
    for i, item in enumerate(value):
        message = _Fields(item, f"messages[{i}]")
        role = message.string("role")
        # OpenAI's "developer" is the system prompt under another name (its reasoning models' term).
        messages.append(router_pb2.ChatMessage(role="system" if role == "developer" else role or "",
                                               content=_content(message.raw("content"), message.name("content"))))
    return messages


def _content(value: Any, name: str) -> str:
    """A message's text: a string, or the text parts of an array joined by newlines (as vLLM does)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return _string(value, name)
    if not isinstance(value, list):
        raise invalid(f"{name} must be a string or an array of content parts, not {_json_type(value)}", name)
    texts = []
    for i, item in enumerate(value):
        part = _Fields(item, f"{name}[{i}]")
        if part.raw("type") != "text":
            raise invalid(f"{part.name('type')} must be \"text\": this model reads text only", part.name("type"))
        texts.append(part.string("text") or "")
    return "\n".join(texts)


def parse_completion(body: Any, served: str, created: int) -> Call:
    """`POST /v1/completions`: a prompt as text or token ids, without a chat template. `logprobs` is the legacy
    integer: that many alternatives per token (0: the chosen token's logprob only)."""
    fields = _Fields(body, "")
    fields.refuse_not_yet(COMPLETION_NOT_YET)
    salt, stream, include_usage = _openai_common(fields, served)
    if fields.raw("prompt") is None:
        raise invalid("prompt is required", "prompt")
    constraint, names = _one_constraint(_openai_constraints(fields), COMPLETION_NAMES)
    top = fields.integer("logprobs", UINT32)
    request = router_pb2.GenerateRequest(stream=stream, cache_salt=salt, sampling=_sampling(
        fields, fields.integer("max_tokens", UINT32), "seed", logprobs=top is not None or None, top_logprobs=top,
        **constraint))
    _set_prompt(request, _one_prompt(fields.raw("prompt"), "prompt"), "prompt")
    return Call(request, OpenAIAnswer(served, created, stream, include_usage, chat=False, logprobs=top is not None),
                names)


def _one_prompt(value: Any, name: str) -> Any:
    """A prompt, or the single prompt of a batch of one: batches of several are not supported yet."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) != 1:
            raise HttpError(400, f"{name} is a batch of {len(value)} prompts, which is not supported yet: send one "
                                 "prompt per request", name, "unsupported_parameter")
        return value[0]
    return value


def _set_prompt(request: router_pb2.GenerateRequest, prompt: Any, name: str) -> None:
    """A string sets `text` (the router refuses an empty one), a non-empty array of integers `token_ids`."""
    if isinstance(prompt, list):
        if not prompt:
            raise invalid(f"{name} must not be an empty array", name)
        request.token_ids.extend(_token_ids(prompt, name))
    elif isinstance(prompt, str):
        request.text = _string(prompt, name)
    else:
        raise invalid(f"{name} must be a string or an array of token ids, not {_json_type(prompt)}", name)


def parse_sglang(body: Any, served: str, created: int) -> Call:
    """SGLang's native `POST /generate`: `text` or `input_ids` (one prompt, no chat template), `sampling_params`
    (with its `json_schema` text, `regex` or `ebnf` grammar), `stream`, `rid`, `return_logprob` with
    `top_logprobs_num` and `return_text_in_logprobs`. There is no `model` field."""
    fields = _Fields(body, "")
    fields.refuse_not_yet(SGLANG_NOT_YET)
    sampling = fields.nested("sampling_params")
    sampling.refuse_not_yet(SGLANG_SAMPLING_NOT_YET)
    stream = bool(fields.boolean("stream"))
    constraint, names = _one_constraint([(sampling.name(field), target, sampling.string(field)) for field, target
                                         in (("json_schema", "json_schema"), ("regex", "regex"), ("ebnf", "grammar"))],
                                        SGLANG_NAMES)
    logprobs, top = fields.boolean("return_logprob"), fields.integer("top_logprobs_num", UINT32)
    request = router_pb2.GenerateRequest(
        stream=stream, cache_salt=fields.string("cache_salt") or "", request_id=fields.string("rid") or "",
        sampling=_sampling(sampling, sampling.integer("max_new_tokens", UINT32), "sampling_seed", logprobs=logprobs,
                           top_logprobs=top, **constraint))
    given = [name for name in ("text", "input_ids") if fields.raw(name) is not None]
    if len(given) != 1:
        raise invalid(f"exactly one of text, input_ids must be set; got {', '.join(given) or 'none'}")
    _set_prompt(request, _one_prompt(fields.raw(given[0]), given[0]), given[0])
    answer = SGLangAnswer(stream, logprobs=bool(logprobs), top=bool(top),
                          with_text=bool(fields.boolean("return_text_in_logprobs")))
    return Call(request, answer, names)


def _usage(usage: router_pb2.Usage) -> dict:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens` as vLLM and SGLang report it (every tier)."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


# The floor of a rendered logprob (-inf is not JSON), as OpenAI and vLLM report "very unlikely".
MIN_LOGPROB = -9999.0


def _logprob(scored: router_pb2.Logprob | router_pb2.TokenLogprobs) -> float:
    return max(scored.logprob, MIN_LOGPROB)


class _ChoiceStream:
    """What a stream has sent of one choice: its role, its tokens' legacy text offset; tokens not yet sent."""

    def __init__(self) -> None:
        self.role_sent = False
        self.pending: list[router_pb2.TokenLogprobs] = []  # tokens of responses that sent no chunk yet
        self.pending_strings: dict[int, tuple[str, bytes]] = {}
        self.offset = 0  # the legacy text_offset of the next token


class OpenAIAnswer:
    """Chat (`chat.completion`, `message`/`delta`) or text (`text_completion`, `text`) completions, one choice per
    sample (`n`). A stream sends each choice's assistant role with its first delta, its `finish_reason` with its
    last, and with `include_usage` a `usage` field on every chunk (null) and a last chunk without choices that
    carries it.

    With `logprobs`, a choice's `logprobs` are chat's `{"content": [{token, logprob, bytes, top_logprobs}]}` or
    the legacy `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}` (offsets into the
    completion's text); a chunk carries its own tokens', and those of tokens that completed no character before it."""

    def __init__(self, model: str, created: int, stream: bool, include_usage: bool, chat: bool, logprobs: bool):
        self.stream = stream
        self._model = model
        self._created = created
        self._include_usage = include_usage
        self._chat = chat
        self._logprobs = logprobs
        self._object = ("chat.completion" if chat else "text_completion") + (".chunk" if chat and stream else "")
        self._choices: dict[int, _ChoiceStream] = {}

    def whole(self, responses: Sequence[router_pb2.GenerateResponse], strings: TokenStrings) -> dict:
        choices = []
        for response in sorted(responses, key=lambda r: r.index):
            text = ({"message": {"role": "assistant", "content": response.text}} if self._chat
                    else {"text": response.text})
            choices.append({"index": response.index, **text,
                            "logprobs": self._render(response.logprobs, strings, _ChoiceStream()),
                            "finish_reason": response.finish_reason})
        return {**self._head(responses[-1]), "choices": choices, "usage": _usage(responses[-1].usage)}

    def events(self, response: router_pb2.GenerateResponse, strings: TokenStrings) -> list[dict]:
        choice = self._choices.setdefault(response.index, _ChoiceStream())
        choice.pending.extend(response.logprobs)
        choice.pending_strings.update(strings)
        if not (response.text or response.finish_reason):
            return []  # a token that completes no character yet
        logprobs = self._render(choice.pending, choice.pending_strings, choice)
        choice.pending, choice.pending_strings = [], {}
        events = [{**self._head(response), "choices": [{
            "index": response.index, **self._delta(response.text, choice), "logprobs": logprobs,
            "finish_reason": response.finish_reason or None}]}]
        if self._include_usage:
            events[0]["usage"] = None
            if response.HasField("usage"):  # the request's last response
                events.append({**self._head(response), "choices": [], "usage": _usage(response.usage)})
        return events

    def _render(self, entries: Sequence[router_pb2.TokenLogprobs], strings: TokenStrings, choice: _ChoiceStream
                ) -> dict | None:
        if not self._logprobs:
            return None
        if self._chat:
            return {"content": [{**_chat_token(e, strings), "top_logprobs": [_chat_token(t, strings) for t in e.top]}
                                for e in entries]}
        tokens = [strings[e.token_id][0] for e in entries]
        offsets = list(itertools.accumulate(map(len, tokens), initial=choice.offset))
        choice.offset = offsets[-1]
        return {"tokens": tokens, "token_logprobs": [_logprob(e) for e in entries],
                "top_logprobs": [{strings[t.token_id][0]: _logprob(t) for t in (e, *e.top)} for e in entries],
                "text_offset": offsets[:-1]}

    def _delta(self, text: str, choice: _ChoiceStream) -> dict:
        if not self._chat:
            return {"text": text}
        delta = {"content": text} if choice.role_sent else {"role": "assistant", "content": text}
        choice.role_sent = True
        return {"delta": delta}

    def _head(self, response: router_pb2.GenerateResponse) -> dict:
        prefix = "chatcmpl-" if self._chat else "cmpl-"
        return {"id": prefix + response.request_id, "object": self._object, "created": self._created,
                "model": self._model}


def _chat_token(scored: router_pb2.Logprob | router_pb2.TokenLogprobs, strings: TokenStrings) -> dict:
    text, raw = strings[scored.token_id]
    return {"token": text, "logprob": _logprob(scored), "bytes": list(raw)}


class SGLangAnswer:
    """SGLang's `{"text", "output_ids", "meta_info"}`. Streamed, every event carries the whole output so far (as
    SGLang does unless started with --incremental-streaming-output) and `meta_info.finish_reason` is null until the
    last; prompt and cached token counts and `e2e_latency` (seconds) are known on the last only.

    With `logprobs`, `meta_info.output_token_logprobs` is `[logprob, token_id, text]` per token, and with `top`
    `output_top_logprobs` such a list per token; the text is null unless `with_text` (return_text_in_logprobs)."""

    def __init__(self, stream: bool, logprobs: bool, top: bool, with_text: bool):
        self.stream = stream
        self._logprobs = logprobs
        self._top = top
        self._with_text = with_text
        self._text: list[str] = []
        self._ids: list[int] = []
        self._token_logprobs: list[list] = []
        self._top_logprobs: list[list[list]] = []

    def whole(self, responses: Sequence[router_pb2.GenerateResponse], strings: TokenStrings) -> dict:
        (response,) = responses  # `n` is not supported here yet
        return self._render(response.text, list(response.token_ids), *self._scored(response, strings), response)

    def events(self, response: router_pb2.GenerateResponse, strings: TokenStrings) -> list[dict]:
        self._text.append(response.text)
        self._ids.extend(response.token_ids)
        token_logprobs, top_logprobs = self._scored(response, strings)
        self._token_logprobs.extend(token_logprobs)
        self._top_logprobs.extend(top_logprobs)
        return [self._render("".join(self._text), list(self._ids), self._token_logprobs, self._top_logprobs,
                             response)]

    def _scored(self, response: router_pb2.GenerateResponse, strings: TokenStrings) -> tuple[list, list]:
        """The response's tokens as SGLang's triples, and their alternatives'."""
        def triple(scored: router_pb2.Logprob | router_pb2.TokenLogprobs) -> list:
            return [_logprob(scored), scored.token_id, strings[scored.token_id][0] if self._with_text else None]
        return [triple(e) for e in response.logprobs], [[triple(t) for t in e.top] for e in response.logprobs]

    def _render(self, text: str, ids: list[int], token_logprobs: list, top_logprobs: list,
                response: router_pb2.GenerateResponse) -> dict:
        meta = {"id": response.request_id, "finish_reason": None, "completion_tokens": len(ids)}
        if self._logprobs:
            meta["output_token_logprobs"] = token_logprobs
        if self._top:
            meta["output_top_logprobs"] = top_logprobs
        if response.finish_reason:
            usage = response.usage
            meta.update(finish_reason=_sglang_finish(response.finish_reason, len(ids)),
                        prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                        e2e_latency=response.timings.e2e_ms / 1e3)
        return {"text": text, "output_ids": ids, "meta_info": meta}


def _sglang_finish(reason: str, completion_tokens: int) -> dict:
    """SGLang's finish reason object. Its `matched` (the stop token or string) is not known here: the worker
    reports only that one matched."""
    if reason == "length":
        return {"type": "length", "length": completion_tokens}
    return {"type": reason}
