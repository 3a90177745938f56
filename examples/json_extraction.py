"""JSON extraction with `json_schema`: the output is compact JSON valid under the schema (the server constrains
the decoding), here for a batch of sentences.

    .venv/bin/python examples/json_extraction.py [router address, default 127.0.0.1:50051]
"""

import json
import sys

from radixserve.lang import Router, assistant, function, gen, system, user

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 20}},
          "required": ["name", "age", "city"]}
SENTENCES = ["Maria is 34 and lives in Lisbon.", "Tom, aged 19, has just moved to Oslo.",
             "In Nairobi lives a teacher named Amina; she is 52."]


@function
def extract(s, sentence):
    s += system("Extract the person described as JSON with their name, age and city.")
    s += user(sentence)
    s += assistant(gen("person", max_tokens=48, temperature=0, json_schema=PERSON))


def main(address: str = "127.0.0.1:50051"):
    states = extract.run_batch([{"sentence": sentence} for sentence in SENTENCES], backend=Router(address))
    people = [json.loads(state["person"]) for state in states]
    for sentence, person in zip(SENTENCES, people):
        print(person, "<-", sentence)
    return people


if __name__ == "__main__":
    main(*sys.argv[1:])
