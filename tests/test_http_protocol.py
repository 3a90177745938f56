"""The HTTP API's translation, without a server: any JSON body is a request the router can run or a 400/404 with
OpenAI's error body; the router's errors keep their meaning in the API's names; streams render as OpenAI and SGLang
clients expect them."""

from __future__ import annotations

import json

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
          "max_new_tokens", "role", "content", "type", "top_logprobs", "guided_json", "guided_regex", "guided_choice",
          "guided_grammar", "json_schema", "schema", "regex", "ebnf", "return_logprob", "top_logprobs_num",
          "return_text_in_logprobs", "stop_token_ids"]
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
    answer = protocol.OpenAIAnswer("m", 7, stream=True, include_usage=True, chat=True, logprobs=False)
    events = [e for r in responses() for e in answer.events(r, {})]
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
    answer = protocol.SGLangAnswer(stream=True, logprobs=False, top=False, with_text=False)
    events = [e for r in responses() for e in answer.events(r, {})]
    assert [(e["text"], e["output_ids"], e["meta_info"]["finish_reason"]) for e in events] == [
        ("Hi", [1], None), ("Hi", [1, 2], None), ("Hi!", [1, 2, 3], {"type": "length", "length": 3})]
    assert events[-1]["meta_info"] == {"id": "r", "finish_reason": {"type": "length", "length": 3},
                                       "completion_tokens": 3, "prompt_tokens": 5, "cached_tokens": 4,
                                       "e2e_latency": 0.25}


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("parse,body,expected", [
    (protocol.parse_chat, {**CHAT, "logprobs": True, "top_logprobs": 2}, {"logprobs": True, "top_logprobs": 2}),
    (protocol.parse_chat, {**CHAT, "response_format": {"type": "text"}}, {}),
    (protocol.parse_chat, {**CHAT, "response_format": {"type": "json_object"}}, {"json_schema": '{"type": "object"}'}),
    (protocol.parse_chat, {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": SCHEMA, "strict": True}}}, {"json_schema": json.dumps(SCHEMA)}),
    (protocol.parse_chat, {**CHAT, "guided_json": SCHEMA}, {"json_schema": json.dumps(SCHEMA)}),
    (protocol.parse_chat, {**CHAT, "guided_json": "{}"}, {"json_schema": "{}"}),
    (protocol.parse_chat, {**CHAT, "guided_choice": ["a", "b"]}, {"choices": ["a", "b"]}),
    (protocol.parse_chat, {**CHAT, "guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
    (protocol.parse_completion, {"prompt": "p", "logprobs": 0}, {"logprobs": True, "top_logprobs": 0}),
    (protocol.parse_completion, {"prompt": "p", "logprobs": 3, "guided_grammar": "root ::= \"x\""},
     {"logprobs": True, "top_logprobs": 3, "grammar": 'root ::= "x"'}),
    (protocol.parse_sglang, {"text": "p", "return_logprob": True, "top_logprobs_num": 1,
                             "sampling_params": {"ebnf": "root ::= \"x\""}},
     {"logprobs": True, "top_logprobs": 1, "grammar": 'root ::= "x"'}),
    (protocol.parse_sglang, {"text": "p", "sampling_params": {"json_schema": "{}"}}, {"json_schema": "{}"}),
])
def test_constraints_and_logprobs_map_to_sampling(parse, body, expected):
    assert parse(body, "m", 0).request.sampling == router_pb2.SamplingParams(**expected)


@pytest.mark.parametrize("parse,body,param,message", [
    (protocol.parse_chat, {**CHAT, "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice",
     ("at most one of response_format, guided_json, guided_regex, guided_choice, guided_grammar may be set; got "
      "guided_regex, guided_choice")),
    (protocol.parse_completion, {"prompt": "p", "response_format": {"type": "json_object"}, "guided_json": {}},
     "guided_json", "got response_format, guided_json"),
    (protocol.parse_sglang, {"text": "p", "sampling_params": {"regex": "a", "ebnf": "b"}}, "sampling_params.ebnf",
     "got sampling_params.regex, sampling_params.ebnf"),
    (protocol.parse_chat, {**CHAT, "response_format": {"type": "json_schema"}}, "response_format.json_schema.schema",
     "is required"),
    (protocol.parse_chat, {**CHAT, "response_format": {"type": "xml"}}, "response_format.type", "not \"xml\""),
    (protocol.parse_chat, {**CHAT, "response_format": "json"}, "response_format", "must be a JSON object"),
    (protocol.parse_chat, {**CHAT, "guided_json": 3}, "guided_json", "must be a JSON schema"),
])
def test_bad_constraints_are_400_naming_the_http_field(parse, body, param, message):
    with pytest.raises(protocol.HttpError) as e:
        parse(body, "m", 0)
    assert (e.value.status, e.value.param) == (400, param) and message in e.value.message


@pytest.mark.parametrize("parse,body,target,expected", [
    (protocol.parse_chat, {**CHAT, "guided_json": {}}, "json_schema", "guided_json"),
    (protocol.parse_completion, {"prompt": "p", "response_format": {"type": "json_object"}}, "json_schema",
     "response_format"),
    (protocol.parse_sglang, {"text": "p", "sampling_params": {"ebnf": "x"}}, "grammar", "sampling_params.ebnf"),
])
def test_a_constraints_compile_error_names_the_field_it_came_from(parse, body, target, expected):
    names = parse(body, "m", 0).names
    assert names.translate(f"sampling.{target} does not compile") == (f"{expected} does not compile", expected)


STRINGS = {1: ("Hi", b"Hi"), 2: ("\ufffd", b"\xe6"), 3: ("!", b"!"), 9: ("Ho", b"Ho")}


def scored_responses() -> list[router_pb2.GenerateResponse]:
    """`responses()` with logprobs: each token with one alternative (token 9)."""
    scored = responses()
    for response, logprob in zip(scored, (-0.5, -1.5, float("-inf")), strict=True):
        (token,) = response.token_ids
        response.logprobs.add(token_id=token, logprob=logprob, top=[router_pb2.Logprob(token_id=9, logprob=-2.0)])
    return scored


def test_chat_logprobs_stream_with_each_chunk_its_tokens():
    answer = protocol.OpenAIAnswer("m", 7, stream=True, include_usage=False, chat=True, logprobs=True)
    chunks = [e["choices"][0]["logprobs"] for r in scored_responses() for e in answer.events(r, STRINGS)]
    top = [{"token": "Ho", "logprob": -2.0, "bytes": [72, 111]}]
    assert chunks == [{"content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": top}]},
                      {"content": [{"token": "\ufffd", "logprob": -1.5, "bytes": [0xe6], "top_logprobs": top},
                                   {"token": "!", "logprob": -9999.0, "bytes": [33], "top_logprobs": top}]}]


def test_completion_logprobs_are_the_legacy_shape_with_offsets_across_chunks():
    answer = protocol.OpenAIAnswer("m", 7, stream=True, include_usage=False, chat=False, logprobs=True)
    chunks = [e["choices"][0]["logprobs"] for r in scored_responses() for e in answer.events(r, STRINGS)]
    assert chunks == [{"tokens": ["Hi"], "token_logprobs": [-0.5], "top_logprobs": [{"Hi": -0.5, "Ho": -2.0}],
                       "text_offset": [0]},
                      {"tokens": ["\ufffd", "!"], "token_logprobs": [-1.5, -9999.0],
                       "top_logprobs": [{"\ufffd": -1.5, "Ho": -2.0}, {"!": -9999.0, "Ho": -2.0}],
                       "text_offset": [2, 3]}]


def test_sglang_logprobs_are_triples_accumulated_over_the_stream():
    answer = protocol.SGLangAnswer(stream=True, logprobs=True, top=True, with_text=True)
    meta = [e for r in scored_responses() for e in answer.events(r, STRINGS)][-1]["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 1, "Hi"], [-1.5, 2, "\ufffd"], [-9999.0, 3, "!"]]
    assert meta["output_top_logprobs"] == [[[-2.0, 9, "Ho"]]] * 3
    whole = protocol.SGLangAnswer(stream=False, logprobs=True, top=False, with_text=False)
    meta = whole.whole([scored_responses()[0]], STRINGS)["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 1, None]] and "output_top_logprobs" not in meta


def test_logprob_token_ids_are_the_chosen_and_the_alternatives():
    assert protocol.logprob_token_ids(scored_responses()[0]) == {1, 9}
    assert protocol.logprob_token_ids(responses()[0]) == set()


def sample(index: int, text: str, finish: str = "", usage: bool = False) -> router_pb2.GenerateResponse:
    response = router_pb2.GenerateResponse(request_id="r", index=index, text=text, token_ids=[1], finish_reason=finish)
    if usage:
        response.usage.CopyFrom(router_pb2.Usage(prompt_tokens=5, completion_tokens=4))
    return response


def test_n_samples_are_one_choice_each_and_usage_comes_once():
    whole = protocol.OpenAIAnswer("m", 7, stream=False, include_usage=False, chat=True, logprobs=False)
    body = whole.whole([sample(1, "b", "stop"), sample(0, "a", "length", usage=True)], {})
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "a", "length"), (1, "b", "stop")]
    assert body["usage"]["completion_tokens"] == 4
    streamed = protocol.OpenAIAnswer("m", 7, stream=True, include_usage=True, chat=True, logprobs=False)
    events = [e for r in (sample(0, "a"), sample(1, "b"), sample(1, "c", "stop"), sample(0, "d", "stop", usage=True))
              for e in streamed.events(r, {})]
    choices = [(c["index"], c["delta"], c["finish_reason"]) for e in events for c in e["choices"]]
    first = {"role": "assistant"}
    assert choices == [(0, {**first, "content": "a"}, None), (1, {**first, "content": "b"}, None),
                       (1, {"content": "c"}, "stop"), (0, {"content": "d"}, "stop")]
    assert [e["usage"] for e in events] == [None] * 4 + [protocol._usage(sample(0, "", usage=True).usage)]


def test_n_and_stop_token_ids_reach_the_router_and_its_errors_name_the_http_fields():
    call = protocol.parse_chat({"messages": [{"role": "user", "content": "x"}], "n": 3, "stop_token_ids": [2, 7]},
                               "m", 0)
    assert call.request.sampling.n == 3 and list(call.request.sampling.stop_token_ids) == [2, 7]
    assert call.names.translate("sampling.n must be in [1, 64], not 0") == ("n must be in [1, 64], not 0", "n")
    sglang = protocol.parse_sglang({"text": "x", "sampling_params": {"stop_token_ids": [4]}}, "m", 0)
    assert list(sglang.request.sampling.stop_token_ids) == [4]
    with pytest.raises(protocol.HttpError, match=r"stop_token_ids\[1\] must be an integer"):
        protocol.parse_completion({"prompt": "x", "stop_token_ids": [1, "a"]}, "m", 0)
