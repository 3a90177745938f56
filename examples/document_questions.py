"""One document, several questions in a `fork`: the document is computed once before the branches start, every
branch reuses it from the cache, and the parent reads the branches' answers back.

    .venv/bin/python examples/document_questions.py [router address, default 127.0.0.1:50051]
"""

import sys

from radixserve.lang import Router, assistant, function, gen, system, user

DOCUMENT = (
    "The town of Eldham lies on the river Wend, two days' walk north of the capital. Its stone bridge, built in "
    "1721, replaced a wooden one that the spring floods of 1719 carried away. The town is known for its wool "
    "market, held every Thursday in the square in front of the town hall, and for the clock in the hall's tower, "
    "which the clockmaker Anna Reyes repaired in 1904 after it had stood still for thirty years. About four "
    "thousand people live in Eldham today; most of them work in the two mills by the river or on the farms around "
    "the town. The railway reached Eldham in 1868, and the old coaching inn by the bridge is now a museum.")
QUESTIONS = ["When was the stone bridge built?", "Who repaired the clock?", "When does the wool market take place?",
             "How many people live in Eldham?"]


@function
def document_questions(s, document, questions):
    s += system("Answer in one short sentence, from this document only.\n\n" + document)
    forks = s.fork(len(questions))
    for fork, question in zip(forks, questions):
        fork += user(question)
        fork += assistant(gen("answer", max_tokens=24, temperature=0))
    answers = "\n".join(f"- {q} {fork['answer']}" for q, fork in zip(questions, forks))
    s += user(f"Questions about the document, answered:\n{answers}\nGive the document a title of a few words.")
    s += assistant(gen("title", max_tokens=12, temperature=0))


def main(address: str = "127.0.0.1:50051"):
    state = document_questions.run(document=DOCUMENT, questions=QUESTIONS, backend=Router(address))
    print(state.messages()[1]["content"])
    print("title:", state["title"])
    return state


if __name__ == "__main__":
    main(*sys.argv[1:])
