"""The whole stack through real processes: a worker with the real default model and the router, on loopback."""

from __future__ import annotations

import json
import subprocess
import time

import grpc
import pytest

from radixserve.v1 import router_pb2, worker_pb2
from tests.stack import GRPCURL, start_stack

pytestmark = pytest.mark.e2e

FRANCE = [router_pb2.ChatMessage(role="user", content="What is the capital of France?")]
GREEDY = router_pb2.SamplingParams(temperature=0, max_new_tokens=24)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_stack(tmp_path_factory.mktemp("logs"))
    yield running
    running.services.stop()


def grpcurl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([GRPCURL, "-plaintext", *args], capture_output=True, text=True, timeout=120)


def generate(stack, **fields) -> list[router_pb2.GenerateResponse]:
    return list(stack.router().Generate(router_pb2.GenerateRequest(**fields), timeout=120))


def test_grpcurl_lists_services_checks_health_and_generates(stack):
    listed = grpcurl(stack.router_address, "list")
    assert listed.returncode == 0, listed.stderr
    assert set(listed.stdout.split()) >= {"radixserve.v1.Router", "grpc.health.v1.Health"}
    health = grpcurl(stack.router_address, "grpc.health.v1.Health/Check")
    assert json.loads(health.stdout)["status"] == "SERVING"
    request = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
               "sampling": {"temperature": 0, "max_new_tokens": 16}}
    out = grpcurl("-d", json.dumps(request), stack.router_address, "radixserve.v1.Router/Generate")
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert "Paris" in reply["text"]
    assert reply["finish_reason"] in ("stop", "length")
    assert int(reply["usage"]["prompt_tokens"]) > 10


def test_streaming_deltas_add_up_to_the_unstreamed_answer(stack):
    streamed = generate(stack, messages=FRANCE, sampling=GREEDY, stream=True)
    whole = generate(stack, messages=FRANCE, sampling=GREEDY)
    assert len(whole) == 1 and len(streamed) > 1
    assert "".join(r.text for r in streamed) == whole[0].text
    assert [t for r in streamed for t in r.token_ids] == list(whole[0].token_ids)
    last = streamed[-1]
    assert last.finish_reason == "stop" and "Paris" in whole[0].text
    assert last.usage.completion_tokens == len(whole[0].token_ids)
    assert 0 < last.timings.ttft_ms <= last.timings.e2e_ms


def test_tokenize_and_list_models_agree_with_generate(stack):
    router = stack.router()
    ids = router.Tokenize(router_pb2.TokenizeRequest(messages=FRANCE)).token_ids
    by_ids = generate(stack, token_ids=ids, sampling=GREEDY)[0]
    by_messages = generate(stack, messages=FRANCE, sampling=GREEDY)[0]
    assert by_ids.token_ids == by_messages.token_ids
    assert by_ids.usage.prompt_tokens == len(ids)
    (model,) = router.ListModels(router_pb2.ListModelsRequest()).models
    assert len(model.fingerprint) == 64 and model.page_size == 16 and model.vocab_size == 49152


LONG = 8192  # the default model's context
BAD_INPUTS = [
    ({}, "exactly one of"),
    ({"text": "hi", "token_ids": [1, 2]}, "exactly one of"),
    ({"text": "hi", "messages": FRANCE}, "exactly one of"),
    ({"text": ""}, "text must not be empty"),
    ({"token_ids": [1, 49152]}, "token_ids[1]"),
    ({"messages": [router_pb2.ChatMessage(role="wizard", content="hi")]}, "messages[0].role"),
    ({"text": "hi", "sampling": router_pb2.SamplingParams(max_new_tokens=0)}, "sampling.max_new_tokens"),
    ({"text": "hi", "sampling": router_pb2.SamplingParams(max_new_tokens=100_000)}, "sampling.max_new_tokens"),
    ({"text": "hi", "sampling": router_pb2.SamplingParams(temperature=-0.5)}, "sampling.temperature"),
    ({"text": "hi", "sampling": router_pb2.SamplingParams(top_p=0)}, "sampling.top_p"),
    ({"text": "hi", "sampling": router_pb2.SamplingParams(top_p=1.5)}, "sampling.top_p"),
    ({"token_ids": [28] * (LONG - 10), "sampling": router_pb2.SamplingParams(max_new_tokens=64)}, "context"),
    ({"text": "x" * 300_000}, "text is 300000 characters"),
]


@pytest.mark.parametrize("fields,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_is_invalid_argument_naming_the_field(stack, fields, message):
    with pytest.raises(grpc.RpcError) as err:
        generate(stack, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert "Paris" in generate(stack, messages=FRANCE, sampling=GREEDY)[0].text  # still healthy


def wait_idle(stack, timeout_s: float = 10) -> worker_pb2.WorkerInfo:
    deadline = time.monotonic() + timeout_s
    while True:
        info = stack.worker().GetInfo(worker_pb2.GetInfoRequest())
        idle = info.running_requests == info.waiting_requests == 0 and info.kv_pages_used == info.kv_pages_cached
        if idle or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


LONG_RUN = router_pb2.SamplingParams(temperature=0, max_new_tokens=2000, ignore_eos=True)


def test_cancel_mid_stream_frees_pages(stack):
    stream = stack.router().Generate(router_pb2.GenerateRequest(text="Count slowly:", sampling=LONG_RUN, stream=True))
    next(stream)
    info = stack.worker().GetInfo(worker_pb2.GetInfoRequest())
    assert info.running_requests == 1 and info.kv_pages_used > info.kv_pages_cached
    stream.cancel()
    info = wait_idle(stack)
    assert (info.running_requests, info.kv_pages_used) == (0, info.kv_pages_cached)


def test_client_deadline_is_honoured_and_frees_pages(stack):
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(stack.router().Generate(router_pb2.GenerateRequest(text="Count slowly:", sampling=LONG_RUN), timeout=1.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 5
    info = wait_idle(stack)
    assert (info.running_requests, info.kv_pages_used) == (0, info.kv_pages_cached)
