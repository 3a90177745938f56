"""`model_worker.grammar` on the real tokenizer, without a model: compiling and its cache, compiler messages,
`choices` as a grammar, the token mask over the model's (possibly padded) vocabulary."""

from __future__ import annotations

import json

import pytest
import torch

from model_worker.grammar import Grammars, TokenMask, choices_ebnf, new_matcher
from model_worker.request import Constraint, ConstraintKind

EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer, len(tokenizer), (EOS,), capacity=3)


def regex(text: str) -> Constraint:
    return Constraint(ConstraintKind.REGEX, text)


def test_a_repeated_spec_compiles_once_and_the_cache_is_lru_by_kind_and_text(grammars):
    start = grammars.compilations
    first = grammars.compile(regex("a+b"))
    assert grammars.compile(regex("a+b")) is first and grammars.compilations == start + 1
    grammars.compile(Constraint(ConstraintKind.GRAMMAR, 'root ::= "a+b"'))  # same text, other kind: compiled
    grammars.compile(regex("c"))
    assert grammars.compilations == start + 3
    grammars.compile(regex("a+b"))  # refreshed: now the most recent of the three
    grammars.compile(regex("d"))  # evicts the grammar, the least recently used
    assert grammars.compilations == start + 4
    assert grammars.compile(regex("a+b")) is first and grammars.compilations == start + 4
    grammars.compile(Constraint(ConstraintKind.GRAMMAR, 'root ::= "a+b"'))
    assert grammars.compilations == start + 5


BAD = [
    (regex("[a-z]+("), "sampling.regex does not compile: Regex parsing error at position 8: The parenthesis is not"),
    (Constraint(ConstraintKind.JSON_SCHEMA, "{bad"),
     "sampling.json_schema is not valid JSON: Expecting property name enclosed in double quotes"),
    (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "nonsense"}'),
     "sampling.json_schema is not a JSON schema: 'nonsense' is not valid under any of the given schemas"),
    (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "integer", "minimum": "x"}'),
     "sampling.json_schema is not a JSON schema: 'x' is not of type 'number'"),
    (Constraint(ConstraintKind.JSON_SCHEMA, "[1, 2]"),
     "sampling.json_schema is not a JSON schema: [1, 2] is not of type 'object', 'boolean'"),
    (Constraint(ConstraintKind.JSON_SCHEMA, "[" * 5000), "sampling.json_schema is nested too deeply"),
    (Constraint(ConstraintKind.GRAMMAR, 'root ::= "a" |'),
     "sampling.grammar does not compile: EBNF parser error at line 1, column 15: Expect element"),
    (Constraint(ConstraintKind.GRAMMAR, "root ::= foo"),
     'sampling.grammar does not compile: EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
    (Constraint(ConstraintKind.GRAMMAR, 'start ::= "a"'),
     'sampling.grammar does not compile: EBNF parser error at line 1, column 1: The root rule with name "root"'),
]


@pytest.mark.parametrize("constraint,message", BAD, ids=[c.spec[:20] for c, _ in BAD])
def test_a_bad_spec_is_a_value_error_with_the_compilers_message(grammars, constraint, message):
    with pytest.raises(ValueError) as err:
        grammars.compile(constraint)
    assert str(err.value).startswith(message)
    assert "/project/" not in str(err.value) and "\n" not in str(err.value)


CHOICES = ("yes", 'say "hi"', "back\\slash", "new\nline", "tab\t", "café ☕", "a|b", "(x)", "\x01ctl", "日本")


def test_choices_match_exactly_one_choice_whatever_it_holds(grammars):
    compiled = grammars.compile(Constraint(ConstraintKind.CHOICES, CHOICES))
    for choice in CHOICES:
        matcher = new_matcher(compiled)
        assert matcher.accept_string(choice) and matcher.is_completed(), choice
    for other in ("ye", "yess", "say hi", "a", "(x", "日"):
        matcher = new_matcher(compiled)
        assert not (matcher.accept_string(other) and matcher.is_completed()), other
    assert choices_ebnf(("a", 'b"')) == 'root ::= "a" | "b\\""'


def test_the_mask_allows_what_the_matcher_allows_on_listed_rows_only(tokenizer, grammars):
    compiled = grammars.compile(Constraint(ConstraintKind.CHOICES, ("yes", "no")))
    logits = torch.zeros(3, len(tokenizer))
    TokenMask(4, len(tokenizer)).apply(logits, [(1, new_matcher(compiled))])
    allowed = torch.isfinite(logits[1]).nonzero()[:, 0].tolist()
    assert allowed and all(tokenizer.decode([t]) in ("y", "ye", "yes", "n", "no") for t in allowed)
    assert torch.isfinite(logits[[0, 2]]).all()  # rows not listed are untouched


def test_eos_is_allowed_exactly_where_the_output_is_complete(tokenizer, grammars):
    matcher = new_matcher(grammars.compile(regex("ab?")))
    mask = TokenMask(1, len(tokenizer))

    def eos_allowed() -> bool:
        logits = torch.zeros(1, len(tokenizer))
        mask.apply(logits, [(0, matcher)])
        return bool(torch.isfinite(logits[0, EOS]))

    assert not eos_allowed()
    assert matcher.accept_token(tokenizer.convert_tokens_to_ids("a")) and eos_allowed()
    assert matcher.accept_token(EOS) and matcher.is_terminated()


def test_padded_vocabulary_rows_are_always_masked(tokenizer):
    """A model whose logits are wider than the tokenizer: the padding ids are never allowed, even by a grammar
    that allows any text."""
    vocab = len(tokenizer) + 64
    padded = Grammars(tokenizer, vocab, (EOS,))
    logits = torch.zeros(1, vocab)
    TokenMask(1, vocab).apply(logits, [(0, new_matcher(padded.compile(regex("[^\\n]*"))))])
    assert not torch.isfinite(logits[0, len(tokenizer):]).any()
    assert torch.isfinite(logits[0, :len(tokenizer)]).sum() > len(tokenizer) // 2


def test_json_is_compact(grammars, tokenizer):
    compiled = grammars.compile(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})))
    assert new_matcher(compiled).accept_string('{"a": 1}')
    assert not new_matcher(compiled).accept_string('{\n  "a": 1}')
