"""The HTTP API's translation, without a server: any JSON body is a request the router can run or a 400/404 with
OpenAI's error body; the router's errors keep their meaning in the API's names; streams render as OpenAI and SGLang
clients expect them."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.server import ServiceError
from radixserve.v1 import router_pb2
from router import http_protocol as protocol

FIELDS = ["messages", "prompt", "text", "input_ids", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "stop", "seed", "sampling_seed", "user", "cache_salt", "stream", "stream_options",
          "include_usage", "n", "logprobs", "response_format", "sampling_params", "rid", "ignore_eos", "model",
          "max_new_tokens", "role", "content", "type"]
SCALARS = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats()
           | st.text(max_size=5) | st.sampled_from(["\ud800", "m", "user", "text"]))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.sampled_from(FIELDS), inner, max_size=4), max_leaves=10)
PARSERS = [protocol.parse_chat, protocol.parse_completion, protocol.parse_sglang]


@settings(max_examples=500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=6) | VALUES,
       parse=st.sampled_from(PARSERS))
def test_any_json_body_is_a_request_or_a_client_error(body, parse):
    try:
        call = parse(body, "m", 0)
    except protocol.HttpError as e:
        assert e.status in (400, 404) and set(e.body()["error"]) == {"message", "type", "param", "code"}
        return
    call.request.SerializeToString()  # every field fits its proto type


@pytest.mark.parametrize("names,message,expected,param", [
    (protocol.COMPLETION_NAMES, "prompt (9 tokens) + sampling.max_new_tokens (8192) exceeds the model context",
     "prompt (9 tokens) + max_tokens (8192) exceeds the model context", "max_tokens"),
    (protocol.COMPLETION_NAMES, "text must not be empty", "prompt must not be empty", "prompt"),
    (protocol.COMPLETION_NAMES, "token_ids[1] = 9 is outside", "prompt[1] = 9 is outside", "prompt"),
    (protocol.CHAT_NAMES, "sampling.stop[2] is 600 characters", "stop[2] is 600 characters", "stop"),
    (protocol.CHAT_NAMES, "messages[0].role 'x' is not one of", "messages[0].role 'x' is not one of", None),
    (protocol.SGLANG_NAMES, "sampling.seed", "sampling_params.sampling_seed", "sampling_params.sampling_seed"),
    (protocol.NO_NAMES, "sampling.top_p must be in (0, 1]", "sampling.top_p must be in (0, 1]", None),
])
def test_router_messages_name_the_fields_the_client_sent(names, message, expected, param):
    assert names.translate(message) == (expected, param)


@pytest.mark.parametrize("code,status,error_code", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, None), (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_exceeded"),
    (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable"), (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout"),
    (grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_api_key"), (grpc.StatusCode.INTERNAL, 500, None),
    (grpc.StatusCode.UNKNOWN, 500, None),
])
def test_router_statuses_map_to_http(code, status, error_code):
    error = protocol.http_error(ServiceError(code, "why", retry_after_s=1.0), protocol.NO_NAMES)
    assert (error.status, error.code, error.retry_after_s, error.message) == (status, error_code, 1.0, "why")


def responses() -> list[router_pb2.GenerateResponse]:
    last = router_pb2.GenerateResponse(request_id="r", text="!", token_ids=[3], finish_reason="length",
                                       usage=router_pb2.Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=4),
                                       timings=router_pb2.Timings(e2e_ms=250))
    return [router_pb2.GenerateResponse(request_id="r", text="Hi", token_ids=[1]),
            router_pb2.GenerateResponse(request_id="r", token_ids=[2]), last]  # a token that completes no character


def test_openai_chat_stream_with_usage():
    answer = protocol.OpenAIAnswer("m", 7, stream=True, include_usage=True, chat=True)
    events = [e for r in responses() for e in answer.events(r)]
    head = {"id": "chatcmpl-r", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
             "prompt_tokens_details": {"cached_tokens": 4}}
    assert events == [
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}, "logprobs": None,
                              "finish_reason": None}], "usage": None},
        {**head, "choices": [{"index": 0, "delta": {"content": "!"}, "logprobs": None, "finish_reason": "length"}],
         "usage": None},
        {**head, "choices": [], "usage": usage}]


def test_sglang_stream_carries_the_whole_output_so_far():
    answer = protocol.SGLangAnswer(stream=True)
    events = [e for r in responses() for e in answer.events(r)]
    assert [(e["text"], e["output_ids"], e["meta_info"]["finish_reason"]) for e in events] == [
        ("Hi", [1], None), ("Hi", [1, 2], None), ("Hi!", [1, 2, 3], {"type": "length", "length": 3})]
    assert events[-1]["meta_info"] == {"id": "r", "finish_reason": {"type": "length", "length": 3},
                                       "completion_tokens": 3, "prompt_tokens": 5, "cached_tokens": 4,
                                       "e2e_latency": 0.25}
