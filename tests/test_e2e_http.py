"""The router's HTTP API through real processes (kvcached, a worker with the real model, the router): the official
`openai` client, SGLang's `/generate` as its documentation calls it with `requests`, and raw HTTP (httpx2, which
the client brings; plain sockets to hang up) for errors and edge cases. One stack for the module; its router admits
one request waiting for a first token (`--max-pending-requests 1`), so that overload is easy to reach, and the last
test stops its worker.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading

import grpc
import httpx2 as httpx
import jsonschema
import openai
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from radixserve.launch import wait_for
from radixserve.v1 import router_pb2, worker_pb2
from tests.stack import document, start_stack

pytestmark = pytest.mark.e2e

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_tokens": 12}
LONG_RUN = {"temperature": 0, "max_tokens": 2000}  # with ignore_eos: runs far longer than any test waits
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_stack(tmp_path_factory.mktemp("logs"), router_args=["--max-pending-requests", "1"])
    yield running
    running.services.stop()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def grpc_greedy(stack, max_new_tokens: int = 12, **prompt) -> router_pb2.GenerateResponse:
    sampling = router_pb2.SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
    (response,) = stack.router().Generate(router_pb2.GenerateRequest(sampling=sampling, **prompt), timeout=120)
    return response


def worker_info(stack) -> worker_pb2.WorkerInfo:
    return stack.worker().GetInfo(worker_pb2.GetInfoRequest(), timeout=5)


def worker_idle(stack) -> bool:
    """The worker runs nothing and holds no pages but cached ones (evictable, owned by no request)."""
    info = worker_info(stack)
    return info.running_requests == info.waiting_requests == 0 and info.kv_pages_used == info.kv_pages_cached


def assert_idle(stack) -> None:
    assert wait_for(lambda: worker_idle(stack)), worker_info(stack)


def test_models_health_and_metrics(stack, client, model):
    (served,) = stack.router().ListModels(router_pb2.ListModelsRequest()).models
    assert model == served.name
    assert client.models.list().data[0].max_model_len == served.max_context == 8192
    assert httpx.get(stack.http_url + "/health").json() == {"status": "serving"}
    metrics = httpx.get(stack.http_url + "/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "radixserve_time_to_first_token_seconds_bucket" in metrics.text


def test_chat_greedy_equals_grpc_and_streams_the_same_text(stack, client, model):
    whole = client.chat.completions.create(model=model, messages=FRANCE, **GREEDY)
    expected = grpc_greedy(stack, messages=[router_pb2.ChatMessage(**m) for m in FRANCE])
    (choice,) = whole.choices
    assert choice.message.content == expected.text and "Paris" in expected.text
    assert choice.message.role == "assistant" and choice.finish_reason == expected.finish_reason
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (expected.usage.prompt_tokens,
                                                                          expected.usage.completion_tokens)
    chunks = list(client.chat.completions.create(model=model, messages=FRANCE, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    *deltas, usage = chunks
    assert len(deltas) > 2 and deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == expected.text
    assert [c.choices[0].finish_reason for c in deltas] == [None] * (len(deltas) - 1) + [expected.finish_reason]
    assert usage.choices == [] and usage.usage.completion_tokens == expected.usage.completion_tokens
    assert all(c.usage is None for c in deltas) and all(c.object == "chat.completion.chunk" for c in chunks)


def test_n_seeded_choices_equal_grpcs_samples_streamed_or_not(stack, client, model):
    sampling = router_pb2.SamplingParams(temperature=1.0, seed=3, max_new_tokens=8, n=3)
    expected = {r.index: r.text for r in stack.router().Generate(router_pb2.GenerateRequest(
        messages=[router_pb2.ChatMessage(**m) for m in FRANCE], sampling=sampling), timeout=120)}
    whole = client.chat.completions.create(model=model, messages=FRANCE, n=3, temperature=1.0, seed=3, max_tokens=8)
    assert {c.index: c.message.content for c in whole.choices} == expected and len(set(expected.values())) > 1
    assert whole.usage.completion_tokens > 8  # summed over the choices
    chunks = list(client.chat.completions.create(model=model, messages=FRANCE, n=3, temperature=1.0, seed=3,
                                                 max_tokens=8, stream=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert texts == expected and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert sum(c.choices[0].finish_reason is not None for c in chunks[:-1]) == 3


def test_completions_from_text_and_token_ids_equal_grpc(stack, client, model):
    prompt = "The capital of France is"
    expected = grpc_greedy(stack, text=prompt)
    by_text = client.completions.create(model=model, prompt=prompt, **GREEDY)
    assert by_text.choices[0].text == expected.text and by_text.object == "text_completion"
    ids = list(stack.router().Tokenize(router_pb2.TokenizeRequest(text=prompt)).token_ids)
    by_ids = client.completions.create(model=model, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == expected.text and by_ids.usage.prompt_tokens == len(ids)
    streamed = list(client.completions.create(model=model, prompt=prompt, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    assert streamed[-1].choices[0].finish_reason == expected.finish_reason


def ask(client, model, doc: str, question: str, **fields):
    messages = [{"role": "system", "content": "Answer from this document.\n" + doc},
                {"role": "user", "content": question}]
    return client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0, **fields)


def test_a_repeated_long_prefix_reports_cached_tokens_per_tenant(client, model):
    doc = document(701)
    first = ask(client, model, doc, "Which lamp was lit?", user="tenant-a")
    again = ask(client, model, doc, "What did the clockmaker repair?", user="tenant-a")
    other = ask(client, model, doc, "What did the clockmaker repair?", user="tenant-b")
    def cached(answer) -> int:
        return answer.usage.prompt_tokens_details.cached_tokens

    assert first.usage.prompt_tokens > 300 and cached(first) == 0
    assert first.usage.prompt_tokens - 64 < cached(again) < again.usage.prompt_tokens and cached(again) % 16 == 0
    assert cached(other) == 0  # `user` is the cache salt: another tenant's prefix is never reused


def test_sglang_generate_as_its_docs_call_it(stack):
    """SGLang's documented `requests` examples, unchanged: the whole answer, then a stream of cumulative texts."""
    expected = grpc_greedy(stack, max_new_tokens=16, text="The capital of France is")
    body = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 16}}
    whole = requests.post(f"{stack.http_url}/generate", json=body, timeout=120).json()
    assert whole["text"] == expected.text and whole["output_ids"] == list(expected.token_ids)
    meta = whole["meta_info"]
    assert meta["finish_reason"]["type"] == expected.finish_reason and meta["id"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (expected.usage.prompt_tokens,
                                                                  expected.usage.completion_tokens)
    assert meta["cached_tokens"] >= 0 and meta["e2e_latency"] > 0

    response = requests.post(f"{stack.http_url}/generate", json={**body, "stream": True}, stream=True, timeout=120)
    texts, metas, done = [], [], False
    for chunk in response.iter_lines(decode_unicode=False):
        chunk = chunk.decode("utf-8")
        if chunk and chunk.startswith("data:"):
            if chunk == "data: [DONE]":
                done = True
                break
            data = json.loads(chunk[5:].strip("\n"))
            texts.append(data["text"])
            metas.append(data["meta_info"])
    assert done and texts[-1] == expected.text and len(texts) > 2
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
    assert [m["finish_reason"] is None for m in metas] == [True] * (len(metas) - 1) + [False]
    assert metas[-1]["completion_tokens"] == expected.usage.completion_tokens


def grpc_scored(stack, top_logprobs: int, **prompt) -> router_pb2.GenerateResponse:
    """`grpc_greedy` with each token's logprob and `top_logprobs` alternatives."""
    sampling = router_pb2.SamplingParams(temperature=0, max_new_tokens=12, logprobs=True, top_logprobs=top_logprobs)
    (response,) = stack.router().Generate(router_pb2.GenerateRequest(sampling=sampling, **prompt), timeout=120)
    return response


def test_chat_logprobs_equal_grpcs_whole_and_streamed(stack, client, model):
    expected = grpc_scored(stack, 2, messages=[router_pb2.ChatMessage(**m) for m in FRANCE])
    whole = client.chat.completions.create(model=model, messages=FRANCE, logprobs=True, top_logprobs=2, **GREEDY)
    content = whole.choices[0].logprobs.content
    assert [t.logprob for t in content] == [t.logprob for t in expected.logprobs]
    assert whole.choices[0].message.content == expected.text and whole.usage.completion_tokens == len(content)
    assert "".join(t.token for t in content) == expected.text + "<|im_end|>"  # the end of sequence is scored too
    assert all(bytes(t.bytes) == t.token.encode() for t in content)  # an ASCII answer: no token splits a character
    for token in content:
        ranked = [t.logprob for t in token.top_logprobs]
        assert len(ranked) == 2 and ranked == sorted(ranked, reverse=True)
        assert token.top_logprobs[0].token == token.token  # greedy takes the raw distribution's argmax
    chunks = client.chat.completions.create(model=model, messages=FRANCE, logprobs=True, top_logprobs=2, stream=True,
                                            **GREEDY)
    streamed = [t for c in chunks for t in c.choices[0].logprobs.content]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in content]


def test_completions_legacy_logprobs_equal_grpcs(stack, client, model):
    prompt = "The capital of France is"
    expected = grpc_scored(stack, 1, text=prompt)
    answer = client.completions.create(model=model, prompt=prompt, logprobs=1, **GREEDY)
    logprobs = answer.choices[0].logprobs
    assert logprobs.token_logprobs == [t.logprob for t in expected.logprobs]
    assert "".join(logprobs.tokens).startswith(answer.choices[0].text) and answer.choices[0].text == expected.text
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    assert [list(top) for top in logprobs.top_logprobs] == [[token] for token in logprobs.tokens]


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
BOB = [{"role": "user", "content": "Describe Bob, who is 42, as JSON."}]


def test_response_format_json_schema_and_guided_choice(client, model):
    answer = client.chat.completions.create(model=model, messages=BOB, temperature=0, max_tokens=48,
                                            response_format={"type": "json_schema", "json_schema": {
                                                "name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)
    assert answer.choices[0].finish_reason == "stop"
    choices = ["Paris", "London", "Berlin"]
    picked = client.chat.completions.create(model=model, messages=FRANCE, temperature=0, max_tokens=8,
                                            extra_body={"guided_choice": choices})
    assert picked.choices[0].message.content in choices


def test_sglang_generate_with_logprobs_and_a_json_schema(stack):
    body = {"text": "Bob is 42. As JSON:", "return_logprob": True, "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 48, "json_schema": json.dumps(PERSON)}}
    answer = requests.post(f"{stack.http_url}/generate", json=body, timeout=120).json()
    jsonschema.validate(json.loads(answer["text"]), PERSON)
    meta = answer["meta_info"]
    assert [token_id for _, token_id, _ in meta["output_token_logprobs"]] == answer["output_ids"]
    assert "".join(text for _, _, text in meta["output_token_logprobs"]).startswith(answer["text"])
    assert [len(top) for top in meta["output_top_logprobs"]] == [2] * len(answer["output_ids"])


BIG = 5 << 20  # over the 4 MiB bound


def chunked_body():
    yield b'{"prompt": "'
    for _ in range(BIG >> 20):
        yield b"a" * (1 << 20)
    yield b'"}'


# (path, body: bytes, an iterator of bytes or JSON, expected status, param, code, a piece of the message)
BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "hi",', 400, None, None, "not valid JSON"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, None, None, "NaN is not a JSON number"),
    ("/v1/completions", b"[" * 100_000, 400, None, None, "not valid JSON"),
    ("/v1/completions", b'{"prompt": "\xff"}', 400, None, None, "not valid JSON"),
    ("/v1/completions", b'{"prompt": "\\ud800"}', 400, "prompt", None, "lone surrogate"),
    ("/v1/chat/completions", [FRANCE], 400, None, None, "must be a JSON object"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", None, "must be a string or an array of token ids"),
    ("/v1/completions", {}, 400, "prompt", None, "prompt is required"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "12"}, 400, "max_tokens", None, "must be an integer"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens", None, "not a boolean"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**40}, 400, "max_tokens", None, "[0, 4294967295]"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", None, "must be a number"),
    ("/v1/completions", {"prompt": "hi", "stop": [1]}, 400, "stop[0]", None, "must be a string"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", None, "non-empty array"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", None,
     "must be a string or an array"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0].type", None, "text only"),
    ("/v1/chat/completions", {"messages": FRANCE, "stream_options": 1}, 400, "stream_options", None,
     "must be a JSON object"),
    ("/generate", {"text": "hi", "sampling_params": []}, 400, "sampling_params", None, "must be a JSON object"),
    # the router's own validation, in the API's field names
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None, "max_tokens must be in [1, 4096]"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", None, "prompt must not be empty"),
    ("/v1/completions", {"prompt": [1, 49152]}, 400, "prompt", None, "prompt[1] = 49152 is outside the vocabulary"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", None, "top_p must be in (0, 1]"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, None, None,
     "messages[0].role 'wizard'"),
    ("/generate", {"input_ids": [28] * 8190, "sampling_params": {"max_new_tokens": 64}}, 400,
     "sampling_params.max_new_tokens", None, "exceeds the model context"),
    ("/generate", {"text": "hi", "input_ids": [1]}, 400, None, None, "exactly one of text, input_ids"),
    # constraints and logprobs
    ("/v1/chat/completions", {"messages": FRANCE, "response_format": {"type": "json_schema", "json_schema": {}}},
     400, "response_format.json_schema.schema", None, "is required"),
    ("/v1/chat/completions", {"messages": FRANCE, "guided_regex": "a+", "guided_choice": ["a"]}, 400,
     "guided_choice", None, "got guided_regex, guided_choice"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "("}, 400, "guided_regex", None,
     "guided_regex does not compile"),
    ("/v1/chat/completions", {"messages": FRANCE, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None,
     "top_logprobs must be in [0, 20]"),
    # not in the engine yet
    ("/v1/chat/completions", {"messages": FRANCE, "n": 0}, 400, "n", None, "n must be in [1, 64], not 0"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo", "unsupported_parameter", "not supported yet"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", "unsupported_parameter", "batch of 2 prompts"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 3}}, 400, "sampling_params.n", "unsupported_parameter",
     "not supported yet"),
    # the model, the path, the method, the size
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": FRANCE}, 404, "model", "model_not_found",
     "does not exist"),
    ("/v1/embeddings", {"input": "hi"}, 404, None, None, "Not Found"),
    ("/v1/completions", b"x" * BIG, 413, None, "request_too_large", "over 4194304 bytes"),
    ("/v1/completions", chunked_body, 413, None, "request_too_large", "over 4194304 bytes"),
]


@pytest.mark.parametrize("path,body,status,param,code,message", BAD_REQUESTS,
                         ids=[f"{p} {m}" for p, _, _, _, _, m in BAD_REQUESTS])
def test_bad_requests_get_an_openai_error_with_the_right_status(stack, path, body, status, param, code, message):
    if callable(body):
        sent = {"content": body()}
    else:
        sent = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(stack.http_url + path, timeout=30, **sent)
    error = response.json()["error"]
    assert (response.status_code, set(error), error["param"], error["code"]) == (status, ERROR_KEYS, param, code)
    assert message in error["message"] and "Traceback" not in response.text


def test_bad_headers_and_methods(stack):
    timeout = httpx.post(stack.http_url + "/v1/chat/completions", json={"messages": FRANCE},
                         headers={"X-Request-Timeout": "soon"}, timeout=30)
    assert timeout.status_code == 400 and timeout.json()["error"]["param"] == "X-Request-Timeout"
    method = httpx.get(stack.http_url + "/v1/chat/completions", timeout=30)
    assert method.status_code == 405 and set(method.json()["error"]) == ERROR_KEYS


def test_still_serving_after_the_bad_requests(stack, client, model):
    answer = client.chat.completions.create(model=model, messages=FRANCE, **GREEDY)
    assert answer.choices[0].message.content == grpc_greedy(stack, messages=[router_pb2.ChatMessage(**FRANCE[0])]).text


def test_openai_client_disconnect_mid_stream_cancels_the_request_and_frees_its_pages(stack, client, model):
    stream = client.chat.completions.create(model=model, messages=FRANCE, stream=True,
                                            extra_body={"ignore_eos": True}, **LONG_RUN)
    next(iter(stream))
    info = worker_info(stack)
    assert info.running_requests == 1 and info.kv_pages_used > info.kv_pages_cached
    stream.close()
    assert_idle(stack)
    assert "Paris" in client.chat.completions.create(model=model, messages=FRANCE, **GREEDY).choices[0].message.content


def raw_request(url: str, path: str, body: dict) -> socket.socket:
    """A connection that has sent one POST and reads nothing."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def test_hanging_up_on_an_unstreamed_request_cancels_it_too(stack, client, model):
    sock = raw_request(stack.http_url, "/v1/completions", {"prompt": "Count slowly:", "ignore_eos": True,
                                                           **LONG_RUN})
    running = wait_for(lambda: worker_info(stack).running_requests == 1)
    sock.close()
    assert running
    assert_idle(stack)


@pytest.mark.parametrize("stream", [False, True])
def test_a_passed_deadline_is_504_or_the_streams_last_event(stack, stream):
    response = httpx.post(stack.http_url + "/v1/completions", headers={"X-Request-Timeout": "2"}, timeout=60,
                          json={"prompt": "Count slowly:", "ignore_eos": True, "stream": stream, **LONG_RUN})
    if stream:
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
        assert response.status_code == 200 and events[-1] == "[DONE]" and len(events) > 2
        error = json.loads(events[-2])["error"]
    else:
        assert response.status_code == 504
        error = response.json()["error"]
    assert error["code"] == "timeout" and set(error) == ERROR_KEYS
    assert_idle(stack)


def test_overload_is_429_with_retry_after(stack, client, model):
    """The router admits one request waiting for its first token; a second one meanwhile is refused at once."""
    long_prompt = document(702, sentences=120)  # a prefill of seconds: the window for the second request
    thread = threading.Thread(target=lambda: httpx.post(stack.http_url + "/v1/completions", timeout=120,
                                                        json={"prompt": long_prompt, "max_tokens": 1}))
    thread.start()
    try:
        assert wait_for(lambda: metric(stack, "radixserve_waiting_queue_size") == 1.0)
        refused = httpx.post(stack.http_url + "/v1/chat/completions", json={"messages": FRANCE}, timeout=30)
        queued_still = metric(stack, "radixserve_waiting_queue_size") == 1.0
    finally:
        thread.join(120)
    assert queued_still, "the first request got its first token before the second was sent: a longer prompt?"
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "router overloaded" in refused.json()["error"]["message"]


def metric(stack, name: str) -> float:
    """The series `name` that the router's /metrics serves, summed over its labels (the model)."""
    text = httpx.get(stack.http_url + "/metrics", timeout=30).text
    values = [s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]
    if not values:
        raise AssertionError(f"no metric {name}")
    return sum(values)


def test_no_worker_is_503_on_health_and_generate(stack, client, model):
    """Last: stops the module's worker."""
    stack.services.stop_service("worker")
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(stack.router_address))
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    assert wait_for(lambda: httpx.get(stack.http_url + "/health").status_code == 503)
    assert wait_for(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == not_serving)
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model=model, messages=FRANCE, **GREEDY)
    assert err.value.status_code == 503 and err.value.body["code"] == "service_unavailable"
