"""A corpus of JSON schemas and regexes for constrained decoding tests, with a prompt for each.

Every spec has a finite longest output (strings, arrays and digits are bounded), so a constrained request always
ends with the end-of-sequence token within `MAX_NEW_TOKENS` (one token per character at worst): "stop", never
"length", greedy or sampled. Regexes are written in the dialect xgrammar and Python's `re` share (ASCII classes,
no look-around), so Python can check each output with `re.fullmatch`.
"""

from __future__ import annotations

MAX_NEW_TOKENS = 160  # above the longest output any spec below allows, in characters

INT_0_9 = {"type": "integer", "minimum": 0, "maximum": 9}
SHORT = {"type": "string", "maxLength": 8}
WORD = {"type": "string", "pattern": "^[a-z]{1,8}$"}


def obj(required: list[str] | None = None, **properties) -> dict:
    """An object schema with these properties, all required unless `required` says which."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required}


# (what the prompt asks for, the schema)
SCHEMAS: list[tuple[str, object]] = [
    ("a number from 1 to 10", {"type": "integer", "minimum": 1, "maximum": 10}),
    ("true or false: the sky is blue", {"type": "boolean"}),
    ("a primary colour", {"type": "string", "enum": ["red", "green", "blue"]}),
    ("a short word", SHORT),
    ("an airport code", {"type": "string", "pattern": "^[A-Z]{3}$"}),
    ("the status", {"const": "ok"}),
    ("nothing", {"type": "null"}),
    ("a power of two", {"type": "integer", "enum": [2, 4, 8, 16]}),
    ("a two to four letter word", {"type": "string", "minLength": 2, "maxLength": 4}),
    ("a negative number", {"type": "integer", "minimum": -99, "maximum": -1}),
    ("a person named Bob aged 42", obj(name={"type": "string", "maxLength": 12},
                                       age={"type": "integer", "minimum": 0, "maximum": 120})),
    ("a point", obj(x={"type": "integer", "minimum": -100, "maximum": 100},
                    y={"type": "integer", "minimum": -100, "maximum": 100})),
    ("a feature flag", obj(enabled={"type": "boolean"})),
    ("a traffic light", obj(light={"enum": ["red", "amber", "green"]})),
    ("a record with an optional label", obj(["a"], a=INT_0_9, b={"type": "string", "maxLength": 5})),
    ("a note, which is optional", obj([], note={"type": "string", "maxLength": 10})),
    ("a user", obj(user=obj(id={"type": "integer", "minimum": 1, "maximum": 999}, active={"type": "boolean"}))),
    ("a deeply nested value", obj(a=obj(b=obj(c=INT_0_9)))),
    ("a date", obj(date={"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"})),
    ("an email address", obj(email={"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"})),
    ("a list of digits", {"type": "array", "items": INT_0_9, "minItems": 1, "maxItems": 3}),
    ("some colours", {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}),
    ("tags for a blog post", obj(tags={"type": "array", "items": {"type": "string", "maxLength": 6},
                                       "maxItems": 3})),
    ("a list of people", {"type": "array", "items": obj(name=SHORT), "minItems": 1, "maxItems": 2}),
    ("a small number or a yes/no", {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5},
                                              {"type": "boolean"}]}),
    ("a line segment", {"$defs": {"p": obj(x=INT_0_9, y=INT_0_9)}, "type": "object",
                        "properties": {"start": {"$ref": "#/$defs/p"}, "end": {"$ref": "#/$defs/p"}},
                        "required": ["start", "end"]}),
    ("a count, or null if unknown", {"type": ["integer", "null"], "minimum": 0, "maximum": 50}),
    ("a closed object", {**obj(k=WORD), "additionalProperties": False}),
    ("a tiny matrix", {"type": "array", "items": {"type": "array", "items": INT_0_9, "maxItems": 2},
                       "minItems": 1, "maxItems": 2}),
    ("any of a few values", {"enum": ["a", 1, True, None]}),
    ("a product", obj(sku={"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                      price={"type": "integer", "minimum": 1, "maximum": 999}, in_stock={"type": "boolean"})),
    ("the weather in Paris", obj(city={"enum": ["Paris", "Rome", "Oslo"]},
                                 temp_c={"type": "integer", "minimum": -50, "maximum": 50},
                                 conditions={"enum": ["sunny", "cloudy", "rain"]})),
    ("a review", obj(["score"], score={"type": "integer", "minimum": 1, "maximum": 5},
                     comment={"type": "string", "maxLength": 20})),
    ("an address", obj(street={"type": "string", "maxLength": 20},
                       zip={"type": "string", "pattern": "^[0-9]{5}$"})),
    ("an answer with a confidence", obj(answer={"enum": ["yes", "no"]},
                                        confidence={"type": "integer", "minimum": 0, "maximum": 100})),
    ("display preferences", obj(theme={"enum": ["light", "dark"]},
                                font_size={"type": "integer", "minimum": 8, "maximum": 32},
                                notifications={"type": "boolean"})),
    ("the size of a grid", obj(rows={"type": "integer", "minimum": 1, "maximum": 10},
                               cols={"type": "integer", "minimum": 1, "maximum": 10})),
    ("a time of day", obj(time={"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"})),
    ("a version", obj(version={"type": "string", "pattern": "^[0-9]{1,2}\\.[0-9]{1,2}\\.[0-9]{1,2}$"})),
    ("a hex colour", {"type": "string", "pattern": "^#[0-9a-f]{6}$"}),
    ("two booleans", {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}),
    ("an event", obj(kind={"const": "event"}, id={"type": "integer", "minimum": 1, "maximum": 99})),
    ("an item with optional metadata", obj(["name"], name=WORD, meta=obj([], v=INT_0_9))),
    ("a pair of a digit and a word", {"type": "array", "prefixItems": [INT_0_9, {"type": "string", "maxLength": 5}],
                                      "items": False, "minItems": 2}),
    ("a digit between 1 and 9", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}),
    ("a big city", {"enum": ["New York", "Los Angeles", "Chicago"]}),
    ("a book", obj(["title", "year"], title={"type": "string", "maxLength": 16},
                   year={"type": "integer", "minimum": 1450, "maximum": 2030},
                   genre={"enum": ["fiction", "science", "history"]}, pages={"type": "integer", "minimum": 1,
                                                                             "maximum": 2000})),
    ("a task list", obj(tasks={"type": "array", "maxItems": 2,
                               "items": obj(title=SHORT, done={"type": "boolean"})})),
    ("a shape", {"anyOf": [obj(circle=obj(r=INT_0_9)), obj(square=obj(side=INT_0_9))]}),
    ("a country code and dialling prefix", obj(code={"type": "string", "pattern": "^[A-Z]{2}$"},
                                               prefix={"type": "string", "pattern": "^\\+[0-9]{1,3}$"})),
    ("a score out of 10", obj(score={"type": "integer", "minimum": 0, "maximum": 10},
                              passed={"type": "boolean"}, grade={"enum": ["A", "B", "C", "F"]})),
    ("a matrix size and a name", obj(["n"], n={"type": "integer", "minimum": 1, "maximum": 4}, label=WORD)),
]

# (what the prompt asks for, the regex)
REGEXES: list[tuple[str, str]] = [
    ("a phone number", r"\d{3}-\d{4}"),
    ("a capitalised name", r"[A-Z][a-z]{2,8}"),
    ("yes or no", r"(yes|no)"),
    ("a price", r"[0-9]{1,3}(\.[0-9]{1,2})?"),
    ("a hex colour", r"#[0-9a-fA-F]{6}"),
    ("an email address", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"),
    ("a date", r"\d{4}-\d{2}-\d{2}"),
    ("a weekday", r"(Mon|Tue|Wed|Thu|Fri|Sat|Sun)"),
    ("a licence plate", r"[A-Z]{2}\d{2} ?[A-Z]{3}"),
    ("true or false", r"(true|false)"),
    ("a US phone number", r"\(\d{3}\) \d{3}-\d{4}"),
    ("a few words", r"[a-z]{1,10}( [a-z]{1,10}){0,3}"),
    ("an integer", r"-?\d{1,4}"),
    ("a number without leading zeros", r"(0|[1-9]\d{0,2})"),
    ("three capitals", r"[A-Z]{3}"),
    ("a version", r"v\d\.\d{1,2}\.\d{1,2}"),
    ("one or two colours", r"(red|green|blue)( and (red|green|blue))?"),
    ("an identifier", r"[A-Za-z_][A-Za-z0-9_]{0,9}"),
    ("a clock time", r"[1-9]\d?:[0-5]\d (am|pm)"),
    ("a multiple-choice answer", r"Answer: (A|B|C|D)"),
    ("a web address", r"https://[a-z]{1,10}\.com/[a-z]{0,8}"),
]
