"""A multi-turn chat, run single, streamed and batched: SGLang's quick-start program with only its import and its
backend line changed.

    .venv/bin/python examples/multi_turn_chat.py [router address, default 127.0.0.1:50051]
"""

import sys

from radixserve.lang import Router, assistant, function, gen, set_default_backend, system, user


@function
def multi_turn_question(s, question_1, question_2):
    s += system("You are a helpful assistant.")
    s += user(question_1)
    s += assistant(gen("answer_1", max_tokens=48))
    s += user(question_2)
    s += assistant(gen("answer_2", max_tokens=48))


def single():
    state = multi_turn_question.run(question_1="What is the capital of the United States?",
                                    question_2="List two local attractions.", temperature=0)
    for m in state.messages():
        print(m["role"], ":", m["content"])
    print(state["answer_1"])
    return state


def stream():
    state = multi_turn_question.run(question_1="What is the capital of the United States?",
                                    question_2="List two local attractions.", temperature=0, stream=True)
    pieces = []
    for out in state.text_iter():
        print(out, end="", flush=True)
        pieces.append(out)
    print()
    return state, "".join(pieces)


def batch():
    states = multi_turn_question.run_batch([
        {"question_1": "What is the capital of the United States?", "question_2": "List two local attractions."},
        {"question_1": "What is the capital of France?", "question_2": "What is the population of this city?"},
    ], temperature=0)
    for s in states:
        print(s.messages())
    return states


def main(address: str = "127.0.0.1:50051"):
    set_default_backend(Router(address))
    return single(), stream(), batch()


if __name__ == "__main__":
    main(*sys.argv[1:])
