"""Structured output, logprobs and parallel sampling through real processes (kvcached, a worker with the real model,
the router): constraints as clients send them (gRPC and grpcurl), logprobs and prompt scoring passed through, `n`
samples and stop token ids, bad specs refused with INVALID_ARGUMENT while the stack keeps serving."""

from __future__ import annotations

import json
import subprocess

import grpc
import jsonschema
import pytest

from radixserve.v1 import router_pb2
from tests.stack import GRPCURL, document, start_stack

pytestmark = pytest.mark.e2e

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
ASK_PERSON = [router_pb2.ChatMessage(role="user", content="Describe Bob, who is 42, as JSON.")]
FRANCE = [router_pb2.ChatMessage(role="user", content="What is the capital of France?")]
CITIES = ["Paris", "London", "Berlin", "Madrid"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # float32, so that prompt scoring can be checked against generation exactly (bfloat16's prefill and decode
    # logits differ in their last bits, ~0.1 in a logprob)
    running = start_stack(tmp_path_factory.mktemp("logs"), worker_args=["--dtype", "float32"])
    yield running
    running.services.stop()


def generate(stack, stream: bool = False, **fields) -> list[router_pb2.GenerateResponse]:
    return list(stack.router().Generate(router_pb2.GenerateRequest(stream=stream, **fields), timeout=120))


def grpcurl(stack, request: dict) -> dict:
    out = subprocess.run([GRPCURL, "-plaintext", "-d", json.dumps(request), stack.router_address,
                          "radixserve.v1.Router/Generate"], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_grpcurl_json_schema_and_choices_as_in_the_readme(stack):
    reply = grpcurl(stack, {"messages": [{"role": "user", "content": "Describe Bob, who is 42, as JSON."}],
                            "sampling": {"temperature": 0, "max_new_tokens": 64, "json_schema": json.dumps(PERSON)}})
    assert reply["finish_reason"] == "stop"
    jsonschema.validate(json.loads(reply["text"]), PERSON)
    reply = grpcurl(stack, {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                            "sampling": {"temperature": 0, "choices": CITIES, "logprobs": True, "top_logprobs": 2}})
    # one of them, chosen token by token (not the likeliest whole choice: rank whole choices by prompt scoring)
    assert reply["text"] in CITIES and reply["finish_reason"] == "stop"
    assert len(reply["logprobs"]) == len(reply["token_ids"]) and len(reply["logprobs"][0]["top"]) == 2


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_choices_return_one_of_the_choices(stack, seed):
    (reply,) = generate(stack, messages=FRANCE, sampling=router_pb2.SamplingParams(
        temperature=1.5, seed=seed, choices=CITIES))
    assert reply.text in CITIES and reply.finish_reason == "stop"


def test_constrained_greedy_output_is_the_same_cold_and_on_a_cache_hit(stack):
    messages = [router_pb2.ChatMessage(role="system", content=document(101)), *ASK_PERSON]
    sampling = router_pb2.SamplingParams(temperature=0, max_new_tokens=64, json_schema=json.dumps(PERSON))
    (cold,) = generate(stack, messages=messages, sampling=sampling)
    (hit,) = generate(stack, messages=messages, sampling=sampling)
    assert cold.usage.cached_tokens == 0 and hit.usage.cached_tokens > 0
    assert hit.token_ids == cold.token_ids and hit.finish_reason == "stop"
    jsonschema.validate(json.loads(hit.text), PERSON)


def test_logprobs_stream_with_their_tokens_and_prompt_scoring_agrees(stack):
    sampling = router_pb2.SamplingParams(temperature=0, max_new_tokens=40, json_schema=json.dumps(PERSON),
                                         logprobs=True, top_logprobs=3)
    streamed = generate(stack, stream=True, messages=ASK_PERSON, sampling=sampling)
    assert all(len(r.logprobs) == len(r.token_ids) for r in streamed)
    tokens = [t for r in streamed for t in r.token_ids]
    logprobs = [lp for r in streamed for lp in r.logprobs]
    assert [lp.token_id for lp in logprobs] == tokens
    assert all(len(lp.top) == 3 and lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob for lp in logprobs)
    assert all(r.prompt_logprobs == [] for r in streamed)
    prompt = list(stack.router().Tokenize(router_pb2.TokenizeRequest(messages=ASK_PERSON)).token_ids)
    (scored,) = generate(stack, token_ids=prompt + tokens, sampling=router_pb2.SamplingParams(
        temperature=0, max_new_tokens=1, prompt_logprobs=True))
    assert scored.usage.cached_tokens == 0  # the prompt's pages were cached by the run above; scoring skips them
    assert [s.token_id for s in scored.prompt_logprobs] == (prompt + tokens)[1:]
    scores = [s.logprob for s in scored.prompt_logprobs[len(prompt) - 1:]]
    assert scores == pytest.approx([lp.logprob for lp in logprobs], abs=1e-4)


def by_index(replies: list[router_pb2.GenerateResponse]) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for reply in replies:
        tokens.setdefault(reply.index, []).extend(reply.token_ids)
    return tokens


def test_n_seeded_samples_are_reproducible_streamed_or_not_and_usage_sums_them(stack):
    messages = [router_pb2.ChatMessage(role="system", content=document(102)),
                router_pb2.ChatMessage(role="user", content="Tell me about the harbour.")]
    sampling = router_pb2.SamplingParams(temperature=1.0, seed=5, max_new_tokens=8, n=4)
    replies = generate(stack, messages=messages, sampling=sampling)
    assert sorted(r.index for r in replies) == [0, 1, 2, 3] and all(r.finish_reason for r in replies)
    assert [r.HasField("usage") for r in replies] == [False] * 3 + [True]
    usage = replies[-1].usage
    assert usage.completion_tokens == sum(len(r.token_ids) for r in replies) and usage.cached_tokens == 0
    samples = by_index(replies)
    assert len({tuple(tokens) for tokens in samples.values()}) > 1  # seed + i: the samples differ
    streamed = generate(stack, stream=True, messages=messages, sampling=sampling)
    assert by_index(streamed) == samples  # the prompt is cached now: a hit changes no sample
    assert streamed[-1].usage.cached_tokens > 0 and streamed[-1].usage.prompt_tokens == usage.prompt_tokens
    assert sorted(r.index for r in streamed if r.finish_reason) == [0, 1, 2, 3]


def test_a_stop_token_id_ends_the_output_there(stack):
    greedy = router_pb2.SamplingParams(temperature=0, max_new_tokens=12)
    (free,) = generate(stack, messages=FRANCE, sampling=greedy)
    stop = free.token_ids[2]
    (stopped,) = generate(stack, messages=FRANCE, sampling=router_pb2.SamplingParams(
        temperature=0, max_new_tokens=12, stop_token_ids=[stop]))
    assert stopped.finish_reason == "stop"
    assert list(stopped.token_ids) == list(free.token_ids[:list(free.token_ids).index(stop) + 1])
    assert free.text.startswith(stopped.text) and len(stopped.text) < len(free.text)


TWO = router_pb2.SamplingParams(regex="a+", choices=["a"])
BAD = [
    (router_pb2.SamplingParams(regex="[a-z]+("), "sampling.regex does not compile: Regex parsing error"),
    (router_pb2.SamplingParams(json_schema="{not json"), "sampling.json_schema is not valid JSON"),
    (router_pb2.SamplingParams(json_schema='{"type": "nonsense"}'), "sampling.json_schema is not a JSON schema"),
    (router_pb2.SamplingParams(json_schema='{"properties": 5}'), "sampling.json_schema is not a JSON schema"),
    (router_pb2.SamplingParams(grammar='root ::= "a" |'), "sampling.grammar does not compile: EBNF parser error"),
    (router_pb2.SamplingParams(grammar='start ::= "a"'), 'The root rule with name "root" is not found'),
    (TWO, ("at most one of sampling.regex, sampling.json_schema, sampling.grammar, sampling.choices may be set; got "
           "regex, choices")),
    (router_pb2.SamplingParams(json_schema="{}", grammar='root ::= "a"'), "got json_schema, grammar"),
    (router_pb2.SamplingParams(regex=""), "sampling.regex must not be empty"),
    (router_pb2.SamplingParams(choices=["a", ""]), "sampling.choices strings must not be empty"),
    (router_pb2.SamplingParams(choices=["c"] * 257), "sampling.choices has 257 strings; the limit is 256"),
    (router_pb2.SamplingParams(regex="a" * 70_000), "sampling.regex is 70000 characters; the limit is 65536"),
    (router_pb2.SamplingParams(regex="a", ignore_eos=True), "sampling.ignore_eos cannot be combined"),
    (router_pb2.SamplingParams(logprobs=True, top_logprobs=21), "sampling.top_logprobs must be in [0, 20]"),
    (router_pb2.SamplingParams(top_logprobs=2), "sampling.top_logprobs needs sampling.logprobs"),
    (router_pb2.SamplingParams(n=0), "sampling.n must be in [1, 64], not 0"),
    (router_pb2.SamplingParams(prompt_logprobs_start=2), "sampling.prompt_logprobs_start needs sampling.prompt_log"),
    (router_pb2.SamplingParams(prompt_logprobs=True, prompt_logprobs_start=99), "must be in [1, 36] for this prompt of 37 tokens"),
    (router_pb2.SamplingParams(n=17), "n (17) exceeds the 16 sequences this worker runs at once"),
    (router_pb2.SamplingParams(stop_token_ids=[10**6]), "sampling.stop_token_ids must be in [0, 49152)"),
]


@pytest.mark.parametrize("sampling,message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_constraints_are_invalid_argument_and_the_stack_serves_on(stack, sampling, message):
    with pytest.raises(grpc.RpcError) as err:
        generate(stack, messages=FRANCE, sampling=sampling)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert "Traceback" not in err.value.details() and "/project/" not in err.value.details()
    (reply,) = generate(stack, messages=FRANCE, sampling=router_pb2.SamplingParams(temperature=0, max_new_tokens=12))
    assert "Paris" in reply.text
