"""radixserve.lang through real processes (kvcached, a float32 worker with the real model, the router): the
examples, greedy results equal to direct Generate calls, `select` against Tokenize and prompt scoring, the cache
that fork and run_batch prime, errors."""

from __future__ import annotations

import asyncio
import importlib

import grpc
import jsonschema
import pytest

from radixserve.lang import Router, RouterError, Selection, assistant, function, gen, select, system, user
from radixserve.v1 import router_pb2
from tests.stack import PAGE, document, start_stack

pytestmark = pytest.mark.e2e

GREEDY = router_pb2.SamplingParams(temperature=0, max_new_tokens=12)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # float32: scores from a batch and from one request alone agree to ~1e-6 (bfloat16's differ by ~0.1)
    running = start_stack(tmp_path_factory.mktemp("logs"), worker_args=["--dtype", "float32"])
    yield running
    running.services.stop()


@pytest.fixture(scope="module")
def backend(stack):
    with Router(stack.router_address) as router:
        yield router


def tokenize(stack, **fields) -> list[int]:
    return list(stack.router().Tokenize(router_pb2.TokenizeRequest(**fields), timeout=30).token_ids)


def chat(*turns: tuple[str, str]) -> list[router_pb2.ChatMessage]:
    return [router_pb2.ChatMessage(role=role, content=content) for role, content in turns]


def direct(stack, **fields) -> router_pb2.GenerateResponse:
    (response,) = stack.router().Generate(router_pb2.GenerateRequest(**fields), timeout=120)
    return response


def common(*sequences: list[int]) -> int:
    return next((i for i, column in enumerate(zip(*sequences)) if len(set(column)) > 1), min(map(len, sequences)))


# -- the examples -------------------------------------------------------------------------------------------------
def test_multi_turn_chat_runs_single_streamed_and_batched(stack):
    single, (streamed, streamed_text), batch = importlib.import_module("examples.multi_turn_chat").main(
        stack.router_address)
    roles = ["system", "user", "assistant", "user", "assistant"]
    assert [m["role"] for m in single.messages()] == roles and single["answer_1"] and single["answer_2"]
    assert streamed_text == single.text() == streamed.text()  # greedy: the same answers, streamed piece by piece
    assert len(batch) == 2 and all([m["role"] for m in s.messages()] == roles for s in batch)
    assert batch[0]["answer_1"] == single["answer_1"] and batch[0]["answer_2"] == single["answer_2"]
    assert single.cached_tokens > 0  # the second turn reused the first


def test_few_shot_select_labels_every_review(stack):
    example = importlib.import_module("examples.few_shot_select")
    states = example.main(stack.router_address)
    labels = [state["sentiment"] for state in states]
    assert len(labels) == len(example.REVIEWS) and set(labels) <= set(example.LABELS)
    assert labels[:2] == [" positive", " negative"]  # the unambiguous ones
    assert all(isinstance(s.get_meta_info("sentiment"), Selection) for s in states)


def test_document_questions_forks_and_reads_the_answers_back(stack):
    example = importlib.import_module("examples.document_questions")
    state = example.main(stack.router_address)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    lines = messages[1]["content"].splitlines()[1:1 + len(example.QUESTIONS)]
    assert [line.split("?")[0] + "?" for line in lines] == [f"- {q}" for q in example.QUESTIONS]
    assert all(line.split("?", 1)[1].strip() for line in lines) and state["title"]


def test_json_extraction_outputs_valid_json(stack):
    example = importlib.import_module("examples.json_extraction")
    people = example.main(stack.router_address)
    assert len(people) == len(example.SENTENCES)
    for person in people:
        jsonschema.validate(person, example.PERSON)
    assert people[0] == {"name": "Maria", "age": 34, "city": "Lisbon"}


# -- the same results as direct calls -----------------------------------------------------------------------------
@function
def three_ways(s, question):
    s += system("Be brief.")
    s += user(question)
    s += assistant(gen("opened", max_tokens=12))
    s += user("Again, starting with 'Answer:'.")
    s += assistant("Answer:" + gen("continued", max_tokens=12))


@function
def plain(s, text):
    s += text + gen("out", max_tokens=12)


def test_greedy_gens_equal_the_direct_generate_calls(stack, backend):
    state = three_ways.run(question="What is the capital of France?", backend=backend, temperature=0)
    first = chat(("system", "Be brief."), ("user", "What is the capital of France?"))
    assert state["opened"] == direct(stack, messages=first, sampling=GREEDY).text
    turns = [*first, *chat(("assistant", state["opened"]), ("user", "Again, starting with 'Answer:'."))]
    ids = tokenize(stack, messages=turns) + tokenize(stack, text="Answer:")
    assert state["continued"] == direct(stack, token_ids=ids, sampling=GREEDY).text
    assert state.messages()[-1] == {"role": "assistant", "content": "Answer:" + state["continued"]}
    text = "The three primary colours are"
    assert plain.run(text=text, backend=backend, temperature=0)["out"] == direct(stack, text=text,
                                                                                   sampling=GREEDY).text


@function
def pick(s, choices):
    s += system("You answer geography questions.")
    s += user("What is the capital of Australia?")
    s += assistant("The capital is" + select("city", choices=choices))


def test_select_picks_the_highest_prompt_score(stack, backend):
    choices = [" Sydney", " Canberra", " Melbourne, the second city", " Perth"]
    state = pick.run(choices=choices, backend=backend)
    prefix = tokenize(stack, messages=chat(("system", "You answer geography questions."),
                                           ("user", "What is the capital of Australia?"))) + tokenize(
        stack, text="The capital is")
    scores = []
    for choice in choices:
        ids = tokenize(stack, text=choice)
        scored = direct(stack, token_ids=prefix + ids, sampling=router_pb2.SamplingParams(
            temperature=0, max_new_tokens=1, prompt_logprobs=True))
        logprobs = [entry.logprob for entry in scored.prompt_logprobs[len(prefix) - 1:]]
        assert len(logprobs) == len(ids)
        scores.append(sum(logprobs) / len(ids))
    best = choices[max(range(len(choices)), key=scores.__getitem__)]
    assert state["city"] == best and state.get_meta_info("city").scores == pytest.approx(scores, abs=1e-4)
    assert state.messages()[-1]["content"] == "The capital is" + best
    assert max(scores) - sorted(scores)[-2] > 1e-3  # a real decision, not a tie


# -- the cache, on purpose ----------------------------------------------------------------------------------------
@function
def ask_all(s, doc, questions, forks):
    s += system("Answer from this document.\n" + doc)
    forks.extend(s.fork(len(questions)))
    for fork, question in zip(forks, questions):
        fork += user(question)
        fork += assistant(gen("answer", max_tokens=4, temperature=0))


QUESTIONS = ["Where is the mill?", "What was lit at dusk?", "Who repaired the bell?", "Name a season."]


def test_forked_branches_reuse_the_prefix_computed_before_them(stack, backend):
    doc, forks = document(1401), []
    state = ask_all.run(doc=doc, questions=QUESTIONS, forks=forks, backend=backend)
    system_turn = chat(("system", "Answer from this document.\n" + doc))
    # the turns before the fork: what a generation prompt and a next turn after them share
    shared = common(tokenize(stack, messages=system_turn),
                    tokenize(stack, messages=[*system_turn, *chat(("user", QUESTIONS[0]))]))
    assert shared > 10 * PAGE
    assert state.cached_tokens == 0 and state.prompt_tokens >= shared  # the priming call, on a new document
    for fork, question in zip(forks, QUESTIONS):
        assert fork["answer"]
        assert fork.prompt_tokens == len(tokenize(stack, messages=[*system_turn, *chat(("user", question))]))
        assert shared // PAGE * PAGE <= fork.cached_tokens <= fork.prompt_tokens


@function
def one_question(s, doc, question):
    s += system("Answer from this document.\n" + doc)
    s += user(question)
    s += assistant(gen("answer", max_tokens=2))


def test_run_batch_of_eight_sharing_a_prefix_computes_it_once(stack, backend):
    doc = document(1402)
    questions = [f"Question {i}: what does line {i} say?" for i in range(8)]
    states = one_question.run_batch([{"doc": doc, "question": q} for q in questions], backend=backend,
                                    max_concurrency=8, temperature=0)
    prompts = [tokenize(stack, messages=chat(("system", "Answer from this document.\n" + doc), ("user", q)))
               for q in questions]
    shared = common(*prompts)
    assert shared > 10 * PAGE
    # every program found the shared prefix cached: none of them computed it, the priming call did, once
    for state, prompt in zip(states, prompts):
        assert state.error is None and state.prompt_tokens == len(prompt)
        assert shared // PAGE * PAGE <= state.cached_tokens < len(prompt)


# -- errors and asyncio -------------------------------------------------------------------------------------------
@function
def constrained(s, regex):
    s += "Digits: " + gen("digits", max_tokens=4, regex=regex, temperature=0)


@function
def branch_fails(s):
    s += "Count: "
    good, bad = s.fork(2)
    good += gen("ok", max_tokens=2)
    bad += gen("no", max_tokens=2, regex="[0-9")


def test_a_failed_call_raises_its_grpc_status_and_fails_only_its_program(backend):
    with pytest.raises(RouterError, match="sampling.regex does not compile") as raised:
        constrained.run(regex="[0-9", backend=backend)
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    states = constrained.run_batch([{"regex": "[0-9]+"}, {"regex": "[0-9"}, {"regex": "[a-z]+"}], backend=backend)
    assert states[0]["digits"].isdigit() and states[2]["digits"].isalpha() and states[1].error is not None
    with pytest.raises(RouterError) as raised:
        states[1]["digits"]
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(RouterError, match="sampling.regex"):
        branch_fails.run(backend=backend)  # a failed branch fails its program


def test_the_asyncio_api_runs_and_streams(backend):
    async def main():
        state = await plain.run_async(text="One, two, three,", backend=backend, temperature=0)
        streamed = await plain.run_async(text="One, two, three,", backend=backend, temperature=0, stream=True)
        pieces = [piece async for piece in streamed.text_async_iter()]
        batch = await plain.run_batch_async([{"text": "One, two, three,"}] * 2, backend=backend, temperature=0)
        return state, pieces, batch

    state, pieces, batch = asyncio.run(main())
    assert "".join(pieces) == state.text() == "One, two, three," + state["out"] and len(pieces) > 2
    assert [s["out"] for s in batch] == [state["out"]] * 2
