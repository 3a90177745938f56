"""The public Router/Generate under generated requests and raw bytes, through real processes (kvcached, a worker
with the real model, the router): every call ends well inside its deadline with OK or INVALID_ARGUMENT, never
UNKNOWN or INTERNAL, and afterwards a greedy request answers exactly as it did before.

Most generated requests break some limit and are refused by validation; the ones that pass ask for one or two tokens
of short prompts (`max_new_tokens` is forced to 1-2 wherever it would be valid), so a case costs milliseconds to a
few hundred of them. The explicit tables check each limit's message.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.server import MAX_DETAILS_CHARS, MAX_MESSAGE_BYTES
from radixserve.v1 import router_pb2
from router.config import RouterConfig
from router.tokenizer import CHAT_ROLES
from tests.stack import start_stack

pytestmark = pytest.mark.e2e

CASES = 1000
GARBAGE_CASES = 300
DEADLINE_S = 30.0
ALLOWED = frozenset({grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT})

DEFAULTS = RouterConfig()
CONTEXT = 8192  # the default model's
VOCAB = 49152
MAX_CHARS = DEFAULTS.max_input_chars
MAX_NEW = DEFAULTS.max_new_tokens_limit
FUZZ = settings(max_examples=CASES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example,
                                       HealthCheck.filter_too_much])

FRANCE = [router_pb2.ChatMessage(role="user", content="What is the capital of France?")]
GREEDY = router_pb2.SamplingParams(temperature=0, max_new_tokens=8)


@dataclass
class Tally:
    """Statuses seen, for the assertions and the report at the end of the module."""

    codes: Counter = field(default_factory=Counter)
    finishes: Counter = field(default_factory=Counter)
    slowest_s: float = 0.0

    def report(self, title: str) -> str:
        rows = [f"  {code.name:<20} {n}" for code, n in self.codes.most_common()]
        rows += [f"  finish {reason!r:<13} {n}" for reason, n in self.finishes.most_common()]
        return f"{title}: {sum(self.codes.values())} calls, slowest {self.slowest_s:.2f} s\n" + "\n".join(rows)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_stack(tmp_path_factory.mktemp("logs"))
    yield running
    running.services.stop()


@pytest.fixture(scope="module")
def tallies():
    found: dict[str, Tally] = {}
    yield found
    print("\n" + "\n".join(t.report(name) for name, t in found.items()))


def greedy_answer(stack) -> tuple[str, list[int]]:
    (response,) = stack.router().Generate(router_pb2.GenerateRequest(messages=FRANCE, sampling=GREEDY), timeout=120)
    return response.text, list(response.token_ids)


@pytest.fixture(scope="module")
def answer_before(stack) -> tuple[str, list[int]]:
    answer = greedy_answer(stack)
    assert "Paris" in answer[0]
    return answer


def check_refusal(err: grpc.RpcError) -> None:
    details = err.details() or ""
    assert details and "\n" not in details and len(details) <= MAX_DETAILS_CHARS, details


def call(tally: Tally, send, allowed: frozenset[grpc.StatusCode] = ALLOWED) -> tuple[grpc.StatusCode, list]:
    """Runs `send()` (a call's responses, or its one response), tallies its status, and checks that the status is
    `allowed` and a refusal's message is one bounded line."""
    started = time.monotonic()
    try:
        result = send()
        responses, code, err = (list(result) if isinstance(result, grpc.Call) else [result]), grpc.StatusCode.OK, None
    except grpc.RpcError as e:
        responses, code, err = [], e.code(), e
    tally.slowest_s = max(tally.slowest_s, time.monotonic() - started)
    tally.codes[code] += 1
    if err is not None:
        assert code in allowed, f"{code.name}: {err.details()}"
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED:  # gRPC's own messages are not ours to bound
            check_refusal(err)
    return code, responses


# -- strategies ---------------------------------------------------------------------------------------------------

NAN, INF = math.nan, math.inf
UNICODE = st.characters(codec="utf-8")  # every code point but surrogates, control characters included
short_text = st.text(UNICODE, max_size=24)
uint32 = st.one_of(st.sampled_from([0, 1, 2, VOCAB - 1, VOCAB, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))


def f32(*edges: float):
    return st.one_of(st.none(), st.sampled_from(edges), st.floats(width=32))


text = st.one_of(short_text, st.sampled_from(["", "\x00", "\u202e\u200b", "🙂" * 8, "x" * (MAX_CHARS + 1),
                                               "é" * (MAX_CHARS + 1)]))
role = st.one_of(st.sampled_from(sorted(CHAT_ROLES)), st.sampled_from(["", "USER", "wizard", "user\x00", "r" * 5000]),
                 st.text(UNICODE, max_size=12))
message = st.builds(router_pb2.ChatMessage, role=role, content=short_text)
messages = st.one_of(
    st.lists(message, min_size=1, max_size=4),
    st.sampled_from([[router_pb2.ChatMessage(role="user")] * (DEFAULTS.max_messages + 1),
                     [router_pb2.ChatMessage(role="user", content="x" * (MAX_CHARS // 2 + 1))] * 2]))
# No valid long prompt: a prefill of thousands of tokens takes seconds here.
token_ids = st.one_of(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24),
                      st.lists(uint32, min_size=1, max_size=8),
                      st.sampled_from([[28] * CONTEXT, [28] * (CONTEXT + 1), [1] * 100_000, [VOCAB], [2**32 - 1]]))
stop = st.one_of(st.lists(st.text(UNICODE, max_size=8), max_size=4),
                 st.sampled_from([[""], ["s"] * (DEFAULTS.max_stop_strings + 1), ["s" * (DEFAULTS.max_stop_chars + 1)],
                                  ["é" * DEFAULTS.max_stop_chars] * DEFAULTS.max_stop_strings]))
identifier = st.one_of(st.text(UNICODE, max_size=12), st.sampled_from(["", "s" * 256, "s" * 257, "é" * 10_000]))


@st.composite
def sampling_params(draw) -> router_pb2.SamplingParams | None:
    """Every field at and beyond its limits; a max_new_tokens that would be valid becomes 1 or 2."""
    fields = dict(temperature=draw(f32(0.0, -0.0, 1e-40, 1e-6, 1e-5, 0.7, 2.0, 3.4e38, -1.0, NAN, INF, -INF)),
                  top_p=draw(f32(0.0, 1e-9, 0.5, 1.0, 1.0000001, 2.0, -1.0, NAN, INF)),
                  top_k=draw(st.none() | uint32), stop=draw(stop), seed=draw(st.none() | st.integers(0, 2**64 - 1)),
                  ignore_eos=draw(st.none() | st.booleans()))
    max_new = draw(st.sampled_from([None, 0, 1, 2, MAX_NEW, MAX_NEW + 1, 100_000, 2**32 - 1]))
    if max_new is None or 1 <= max_new <= MAX_NEW:
        max_new = draw(st.sampled_from([1, 2]))
    sampling = router_pb2.SamplingParams(max_new_tokens=max_new, **{k: v for k, v in fields.items() if v is not None})
    return sampling


@st.composite
def generate_requests(draw) -> router_pb2.GenerateRequest:
    inputs = draw(st.one_of(st.sampled_from([("text",), ("messages",), ("token_ids",)]),
                            st.lists(st.sampled_from(["text", "messages", "token_ids"]), max_size=3, unique=True)))
    strategies = {"text": text, "messages": messages, "token_ids": token_ids}
    request = router_pb2.GenerateRequest(**{name: draw(strategies[name]) for name in inputs},
                                         sampling=draw(sampling_params()), stream=draw(st.booleans()),
                                         cache_salt=draw(identifier), request_id=draw(identifier))
    return request


@st.composite
def valid_requests(draw) -> router_pb2.GenerateRequest:
    """Requests within every limit, with odd but valid values: these reach the worker and generate 1-2 tokens."""
    kind = draw(st.sampled_from(["text", "messages", "token_ids"]))
    prompt = draw({"text": st.text(UNICODE, min_size=1, max_size=24),
                   "messages": st.lists(st.builds(router_pb2.ChatMessage, role=st.sampled_from(sorted(CHAT_ROLES)),
                                                  content=short_text), min_size=1, max_size=3),
                   "token_ids": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)}[kind])
    fields = dict(temperature=draw(st.one_of(st.none(), st.sampled_from([0.0, 1e-40, 1e-6, 1e-5, 1.0, 3.4e38]),
                                             st.floats(0, 100, width=32))),
                  top_p=draw(st.one_of(st.none(), st.sampled_from([1e-9, 0.5, 1.0]),
                                       st.floats(0, 1, exclude_min=True, width=32))),
                  top_k=draw(st.none() | uint32), seed=draw(st.none() | st.integers(0, 2**64 - 1)),
                  ignore_eos=draw(st.none() | st.booleans()))
    sampling = router_pb2.SamplingParams(max_new_tokens=draw(st.sampled_from([1, 2])),
                                         stop=draw(st.lists(st.text(UNICODE, min_size=1, max_size=8), max_size=4)),
                                         **{k: v for k, v in fields.items() if v is not None})
    return router_pb2.GenerateRequest(**{kind: prompt}, sampling=sampling, stream=draw(st.booleans()),
                                      cache_salt=draw(st.text(UNICODE, max_size=12)),
                                      request_id=draw(st.text(UNICODE, max_size=12)))


# A quarter valid: enough to exercise generation with odd sampling, few enough to keep the file near 2 minutes.
any_requests = st.one_of(generate_requests(), generate_requests(), generate_requests(), valid_requests())
small_requests = any_requests.filter(lambda request: request.ByteSize() <= 1024)
FAST = router_pb2.GenerateRequest(sampling=router_pb2.SamplingParams(max_new_tokens=1)).SerializeToString()


@st.composite
def garbage(draw) -> bytes:
    """Random bytes, or the bytes of a generated request of at most 1 KiB with some flipped. Bytes that happen to
    parse get a trailing max_new_tokens=1 (the last value of a field wins), so that whatever they ask stays fast.
    (A flip in a larger request can turn a refused one into a valid long prompt, by renaming the field that broke
    a limit into an unknown one: its prefill can outlast the deadline. The long requests are generated above.)"""
    if draw(st.booleans()):
        data = draw(st.binary(max_size=256))
    else:
        data = bytearray(draw(small_requests).SerializeToString())
        for at, value in draw(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1,
                                       max_size=4)):
            if data:
                data[at % len(data)] = value
        data = bytes(data)
    try:
        router_pb2.GenerateRequest.FromString(data)
    except Exception:  # noqa: BLE001 -- protobuf's DecodeError: the server must refuse it
        return data
    return data + FAST


# -- fuzzing ------------------------------------------------------------------------------------------------------

def test_generated_requests_end_with_ok_or_invalid_argument(stack, answer_before, tallies):
    tally = tallies.setdefault("Router/Generate, generated GenerateRequests", Tally())
    router = stack.router()

    @FUZZ
    @given(request=any_requests)
    def case(request: router_pb2.GenerateRequest) -> None:
        code, responses = call(tally, lambda: router.Generate(request, timeout=DEADLINE_S))
        if code == grpc.StatusCode.OK:
            last = responses[-1]
            tally.finishes[last.finish_reason] += 1
            assert last.finish_reason in ("stop", "length")
            assert sum(len(r.token_ids) for r in responses) <= request.sampling.max_new_tokens
            assert request.stream or len(responses) == 1
            assert not request.request_id or last.request_id == request.request_id

    case()
    assert sum(tally.codes.values()) >= CASES
    assert greedy_answer(stack) == answer_before


def test_raw_bytes_end_with_ok_or_invalid_argument(stack, answer_before, tallies):
    tally = tallies.setdefault("Router/Generate, raw bytes", Tally())
    channel = grpc.insecure_channel(stack.router_address)
    generate = channel.unary_stream("/radixserve.v1.Router/Generate", request_serializer=None,
                                    response_deserializer=None)

    @settings(FUZZ, max_examples=GARBAGE_CASES)
    @given(data=garbage())
    def case(data: bytes) -> None:
        call(tally, lambda: generate(data, timeout=DEADLINE_S))

    case()
    assert greedy_answer(stack) == answer_before


# -- each limit, exactly ------------------------------------------------------------------------------------------

def fast(**fields) -> router_pb2.GenerateRequest:
    sampling = fields.pop("sampling", router_pb2.SamplingParams(temperature=0, max_new_tokens=1))
    return router_pb2.GenerateRequest(sampling=sampling, **fields)


def with_stop(*strings: str) -> router_pb2.SamplingParams:
    return router_pb2.SamplingParams(max_new_tokens=1, stop=strings)


REFUSED = [
    (fast(messages=[router_pb2.ChatMessage(role="user", content="hi")] * 1025),
     "messages has 1025 messages; the limit is 1024"),
    (fast(messages=[router_pb2.ChatMessage(role="r" * 5000, content="hi")]), "messages[0].role 'rrrr"),
    (fast(text="hi", sampling=with_stop("s" * 513)), "sampling.stop[0] is 513 characters; the limit is 512"),
    (fast(text="hi", sampling=with_stop(*["s"] * 17)), "sampling.stop has 17 strings; the limit is 16"),
    (fast(text="hi", cache_salt="s" * 257), "cache_salt is 257 characters; the limit is 256"),
    (fast(text="hi", request_id="r" * 257), "request_id is 257 characters; the limit is 256"),
    (fast(token_ids=[28] * 100_000), "token_ids has 100000 ids; the limit is the model context of 8192"),
    (fast(token_ids=[28] * CONTEXT), "exceeds the model context of 8192"),
    (fast(messages=[router_pb2.ChatMessage(role="user", content="x" * (MAX_CHARS // 2 + 1))] * 2),
     "messages is 262146 characters; the limit is 262144"),
    (fast(text="hi", sampling=router_pb2.SamplingParams(temperature=NAN, max_new_tokens=1)), "sampling.temperature"),
    (fast(text="hi", sampling=router_pb2.SamplingParams(temperature=INF, max_new_tokens=1)), "sampling.temperature"),
    (fast(text="hi", sampling=router_pb2.SamplingParams(top_p=NAN, max_new_tokens=1)), "sampling.top_p"),
]


@pytest.mark.parametrize("request_,message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_each_limit_is_invalid_argument_naming_the_field_and_the_limit(stack, request_, message):
    with pytest.raises(grpc.RpcError) as err:
        list(stack.router().Generate(request_, timeout=DEADLINE_S))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    check_refusal(err.value)


def test_the_longest_allowed_identifiers_and_stop_strings_are_served(stack):
    request = fast(text="hi", cache_salt="s" * 256, request_id="r" * 256, sampling=with_stop(*["é" * 512] * 16))
    (response,) = stack.router().Generate(request, timeout=DEADLINE_S)
    assert response.request_id == "r" * 256 and response.finish_reason in ("stop", "length")


def test_a_temperature_below_1e_5_is_greedy(stack):
    def tokens(temperature: float) -> list[int]:
        sampling = router_pb2.SamplingParams(temperature=temperature, max_new_tokens=4, seed=7)
        (response,) = stack.router().Generate(router_pb2.GenerateRequest(messages=FRANCE, sampling=sampling),
                                              timeout=DEADLINE_S)
        return list(response.token_ids)

    greedy = tokens(0.0)
    assert tokens(1e-40) == tokens(1e-6) == greedy and len(greedy) == 4


@pytest.mark.parametrize("data,message", [(b"\x0a\x02\xff\xfe", "bad UTF-8"),
                                          (b"\x12\x04\x12\x02\xc3\x28", "bad UTF-8"),  # messages[0].content
                                          (b"\x0a\x10hi", "Error parsing message")])
def test_bytes_that_are_no_request_are_invalid_argument(stack, data, message):
    generate = grpc.insecure_channel(stack.router_address).unary_stream("/radixserve.v1.Router/Generate")
    with pytest.raises(grpc.RpcError) as err:
        list(generate(data, timeout=DEADLINE_S))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()


def test_a_request_over_the_message_limit_is_resource_exhausted(stack):
    with pytest.raises(grpc.RpcError) as err:
        list(stack.router().Generate(router_pb2.GenerateRequest(text="x" * MAX_MESSAGE_BYTES), timeout=DEADLINE_S))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in err.value.details()
