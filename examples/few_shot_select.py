"""Few-shot classification with `select`: the examples are a prefix every input shares; `select` ranks the labels
by the model's score of each whole label after the prompt.

    .venv/bin/python examples/few_shot_select.py [router address, default 127.0.0.1:50051]
"""

import sys

from radixserve.lang import Router, function, select

LABELS = [" positive", " negative", " neutral"]
SHOTS = [("The food was wonderful and the staff were kind.", "positive"),
         ("We waited an hour and the soup was cold.", "negative"),
         ("The restaurant is on the corner of the main square.", "neutral"),
         ("Best pastries I have had in years, I will be back.", "positive"),
         ("The waiter was rude and the bill was wrong.", "negative"),
         ("They open at nine and close at six on weekdays.", "neutral")]
REVIEWS = ["An absolute delight from start to finish.", "The room smelled of smoke and the bed was broken.",
           "The museum has three floors and a cafe.", "I loved the view, the music and the desserts."]


@function
def classify(s, review):
    s += "Classify the sentiment of each review as positive, negative or neutral.\n\n"
    for text, label in SHOTS:
        s += f"Review: {text}\nSentiment: {label}\n\n"
    s += f"Review: {review}\nSentiment:"
    s += select("sentiment", choices=LABELS)


def main(address: str = "127.0.0.1:50051"):
    states = classify.run_batch([{"review": review} for review in REVIEWS], backend=Router(address))
    for review, state in zip(REVIEWS, states):
        print(f"{state['sentiment'].strip():>8}  {review}")
    return states


if __name__ == "__main__":
    main(*sys.argv[1:])
