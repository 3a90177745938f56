"""radixserve.lang programs against the same calls sent naively, one by one, with no priming (issue 14), through
one real stack (kvcached, a worker, the router on loopback). Each side gets its own text cut from the corpus, so
neither finds the other's prefix cached.

- document: one document (~600 tokens) and 8 questions, 24 greedy tokens each. Program: `fork(8)` (the document
  primed once, the branches concurrent). Naive: 8 Generate calls of the same messages, one after another.
- classifier: a few-shot prefix (~250 tokens) and 16 inputs, 3 labels. `select`: run_batch of 16 programs
  against the same prompt-scoring calls (one per label, scored from the label on, reusing the cached prompt) one
  by one. `gen(choices=)` (the server's constrained decoding, which reuses the cache): run_batch
  against 16 Generate calls one by one.

Rows per workload: end-to-end time, mean TTFT per call as the client sees it (the program's priming calls left
out), cached-token ratio (cached / prompt tokens over every call, priming included).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import NamedTuple

import grpc

from bench import Row, local_services
from radixserve.lang import Router, assistant, function, gen, select, system, user
from radixserve.v1 import router_pb2, router_pb2_grpc

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
QUESTIONS = ["Who is named first?", "What is traded?", "Which town is named?", "What sum is named?",
             "What is forbidden?", "Who signs it?", "What year is it?", "What is the penalty?"]
LABELS = [" trade", " law", " letter"]
GOAL = "programs >= 2x faster end to end"


@function
def document_questions(s, document, questions, answers):
    s += system("Answer in one short sentence from this document.\n\n" + document)
    forks = s.fork(len(questions))
    for fork, question in zip(forks, questions):
        fork += user(question)
        fork += assistant(gen("answer", max_tokens=24))
    answers.extend(forks)


@function
def classify_select(s, shots, text):
    s += shots + f"Passage: {text}\nKind:" + select("kind", choices=LABELS)


@function
def classify_gen(s, shots, text):
    s += shots + f"Passage: {text}\nKind:" + gen("kind", max_tokens=4, choices=LABELS)


class Texts(NamedTuple):
    """All distinct, cut from the corpus's paragraphs: two documents (~600 tokens), four few-shot prefixes (~250
    tokens: one per run of a classifier), 4 x 16 passages."""

    documents: list[str]
    shots: list[str]
    passages: list[list[str]]


def _texts() -> Texts:
    paragraphs = [p.replace("\n", " ") for p in CORPUS.read_text().split("\n\n") if len(p) > 300]
    documents = [" ".join(paragraphs[0:3]), " ".join(paragraphs[3:6])]
    shots = ["Say what kind of text each passage is: trade, law or letter.\n\n" + "".join(
        f"Passage: {p[:200]}\nKind: {label.strip()}\n\n" for p, label in zip(paragraphs[i:i + 3], LABELS))
        for i in (6, 9, 12, 15)]
    passages = [p[:160] for p in paragraphs[18:]] * 2
    return Texts(documents, shots, [passages[i * 16:(i + 1) * 16] for i in range(4)])


class _Calls:
    """The naive client: a sync stub, each call timed to its first message."""

    def __init__(self, address: str):
        self._stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(address))
        self.ttfts: list[float] = []
        self.prompt = self.cached = 0

    def generate(self, **fields) -> router_pb2.GenerateResponse:
        started, first = time.perf_counter(), None
        for response in self._stub.Generate(router_pb2.GenerateRequest(stream=True, **fields), timeout=600):
            first = first or time.perf_counter()
        self.ttfts.append(first - started)
        self.prompt += response.usage.prompt_tokens
        self.cached += response.usage.cached_tokens
        return response

    def side(self, started: float) -> Side:
        """The calls made since `started` (perf_counter), all of this client's."""
        return Side(time.perf_counter() - started, self.ttfts, self.cached / self.prompt)

    def tokenize(self, **fields) -> list[int]:
        return list(self._stub.Tokenize(router_pb2.TokenizeRequest(**fields), timeout=60).token_ids)


class Side(NamedTuple):
    seconds: float
    ttfts: list[float]  # [] where the calls are not timed one by one
    cached_ratio: float


def _rows(name: str, program: Side, naive: Side) -> list[Row]:
    rows = [Row(f"{name}: end to end", program.seconds, naive.seconds, "s", GOAL),
            Row(f"{name}: cached-token ratio", program.cached_ratio, naive.cached_ratio, "", "")]
    if program.ttfts:
        rows.insert(1, Row(f"{name}: TTFT per call (mean)", statistics.mean(program.ttfts) * 1e3,
                           statistics.mean(naive.ttfts) * 1e3, "ms", ""))
    return rows


def _ratio(states) -> float:
    return sum(s.cached_tokens for s in states) / sum(s.prompt_tokens for s in states)


def document_rows(backend: Router, calls: _Calls, documents: list[str]) -> list[Row]:
    started, forks = time.perf_counter(), []
    state = document_questions.run(document=documents[0], questions=QUESTIONS, answers=forks, backend=backend,
                                   temperature=0)
    program = Side(time.perf_counter() - started, [f.get_meta_info("answer").ttft_s for f in forks],
                   _ratio([state, *forks]))
    started = time.perf_counter()
    for question in QUESTIONS:
        calls.generate(messages=[router_pb2.ChatMessage(role="system", content="Answer in one short sentence from "
                                                        "this document.\n\n" + documents[1]),
                                 router_pb2.ChatMessage(role="user", content=question)],
                       sampling=router_pb2.SamplingParams(temperature=0, max_new_tokens=24))
    return _rows("document, 8 questions (fork)", program, calls.side(started))


def classifier_rows(backend: Router, calls: _Calls, shots: list[str], passages: list[list[str]],
                    scoring: bool) -> list[Row]:
    """`shots` and `passages`: two each, the program's and the naive client's."""
    program_fn = classify_select if scoring else classify_gen
    started = time.perf_counter()
    states = program_fn.run_batch([{"shots": shots[0], "text": t} for t in passages[0]], backend=backend,
                                  max_concurrency=16, temperature=0)
    # a select's scoring calls are not timed one by one
    program = Side(time.perf_counter() - started, [] if scoring else [s.get_meta_info("kind").ttft_s for s in states],
                   _ratio(states))
    started = time.perf_counter()
    for text in passages[1]:
        prompt = shots[1] + f"Passage: {text}\nKind:"
        if scoring:
            prefix = calls.tokenize(text=prompt)
            for label in LABELS:
                calls.generate(token_ids=prefix + calls.tokenize(text=label), sampling=router_pb2.SamplingParams(
                    temperature=0, max_new_tokens=1, prompt_logprobs=True, prompt_logprobs_start=len(prefix)))
        else:
            calls.generate(text=prompt, sampling=router_pb2.SamplingParams(temperature=0, max_new_tokens=4,
                                                                           choices=LABELS))
    return _rows(f"classifier, 16 inputs ({'select' if scoring else 'gen choices'})", program, calls.side(started))


def run(dtype: str) -> list[Row]:
    with local_services("lang") as services:
        kvcached = services.kvcached()
        router = services.router([services.worker(kvcached, args=["--dtype", dtype])], kvcached)
        texts = _texts()
        with Router(router) as backend:
            return [*document_rows(backend, _Calls(router), texts.documents),
                    *classifier_rows(backend, _Calls(router), texts.shots[:2], texts.passages[:2], scoring=True),
                    *classifier_rows(backend, _Calls(router), texts.shots[2:], texts.passages[2:], scoring=False)]


if __name__ == "__main__":
    from bench.__main__ import table
    print(table("radixserve.lang programs vs naive calls", run("float32")))
