"""radixserve.lang's pure core: expressions, transcripts and the prompts their calls send, choice scoring, run
keywords, and finding a program's first call without the model."""

from __future__ import annotations

import pytest

from radixserve.lang import assistant, function, gen, select, system, user
from radixserve.lang.interpreter import _shaped
from radixserve.lang.ir import Constraint, Gen, RoleBegin, RoleEnd, SamplingOptions, Text, flatten
from radixserve.lang.transcript import Prompt, Transcript, best_choice, choice_score, common_prefix


def run(transcript: Transcript, *exprs) -> Transcript:
    for expr in exprs:
        transcript = _shaped(transcript, flatten(expr))
    return transcript


def test_an_expression_flattens_into_its_operations_in_order():
    answer = gen("a", max_tokens=4)
    assert flatten(user("Q") + assistant("A: " + answer)) == [
        RoleBegin("user"), Text("Q"), RoleEnd(), RoleBegin("assistant"), Text("A: "), answer, RoleEnd()]


@pytest.mark.parametrize("kwargs, constraint", [
    ({}, None), ({"regex": "a+"}, Constraint("regex", "a+")),
    ({"json_schema": {"type": "integer"}}, Constraint("json_schema", '{"type": "integer"}')),
    ({"json_schema": '{"type": "integer"}'}, Constraint("json_schema", '{"type": "integer"}')),
    ({"choices": ["x", "y"]}, Constraint("choices", ("x", "y")))])
def test_gen_takes_one_constraint(kwargs, constraint):
    assert gen("g", **kwargs).constraint == constraint


def test_gen_refuses_two_constraints_and_select_needs_choices():
    with pytest.raises(ValueError, match="at most one"):
        gen("g", regex="a", choices=["a"])
    with pytest.raises(ValueError, match="at least one choice"):
        select("s", choices=[])


def test_a_gens_unset_options_come_from_the_runs_defaults():
    defaults = SamplingOptions(max_tokens=64, stop=("\n",), temperature=0.0, seed=3)
    assert gen("g", max_tokens=8).sampling.over(defaults) == SamplingOptions(8, ("\n",), 0.0, None, None, 3)
    assert gen("g", stop="x", temperature=0.7).sampling.over(defaults) == SamplingOptions(64, ("x",), 0.7, None,
                                                                                          None, 3)


def test_plain_text_calls_send_all_the_text():
    t = run(Transcript(), "Once upon", " a time")
    assert not t.chat and t.prompt() == Prompt(None, "Once upon a time") and t.text() == "Once upon a time"
    assert t.fork_prompts() == [Prompt(None, "Once upon a time"), Prompt(None, "Once upon a time .")]


def test_chat_calls_send_the_turns_then_the_open_assistant_text():
    t = run(Transcript(), system("S"), user("Q"), assistant(""))
    assert t.turns == (("system", "S"), ("user", "Q"), ("assistant", "")) and t.open_role is None
    opened = Transcript(t.turns[:2]).begin("assistant")
    assert opened.prompt() == Prompt((("system", "S"), ("user", "Q")), "")
    assert opened.append("A: ").prompt() == Prompt((("system", "S"), ("user", "Q")), "A: ")
    assert opened.append("x").messages()[-1] == {"role": "assistant", "content": "x"}
    assert t.text() == "S\nQ\n"
    assert Transcript(t.turns[:1]).fork_prompts() == [Prompt((("system", "S"),), ""),
                                                      Prompt((("system", "S"), ("user", ".")), "")]


@pytest.mark.parametrize("exprs, message", [
    ((system("S"), "loose text"), "text outside a role segment"),
    (("plain", user("Q")), "plain text or chat turns"),
    ((user("Q" + gen("g")),), "inside assistant"),
    ((gen("g"),), "needs some prompt text"),
    ((assistant(user("Q")),), "do not nest")])
def test_a_program_of_the_wrong_shape_fails_at_its_line(exprs, message):
    with pytest.raises(ValueError, match=message):
        run(Transcript(), *exprs)


def test_common_prefix():
    assert common_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == [1, 2]
    assert common_prefix([[1, 2], [1, 2, 3]]) == [1, 2] and common_prefix([[7]]) == [7] and common_prefix([]) == []
    assert common_prefix([[1], [2]]) == []


def test_choices_score_by_mean_token_logprob_and_ties_go_to_the_first():
    assert choice_score([-1.0, -3.0]) == -2.0
    scores = [choice_score([-1.0]), choice_score([-0.5, -0.5, -0.5]), choice_score([-0.5])]
    assert best_choice(scores) == 1 and best_choice([-2.0, -1.0, -1.0]) == 1


@function
def chat(s, question, temperature):  # a parameter named like a run keyword is the program's
    s += system("Be brief.")
    s += user(question)
    s += assistant(gen("a"))


@function
def doc_then_fork(s, doc):
    s += "Doc: " + doc
    s.fork(2)


def test_run_keywords_split_into_program_arguments_and_gen_defaults():
    assert chat._split({"question": "q", "temperature": 0.5, "max_new_tokens": 9, "stop": "."}) == (
        {"question": "q", "temperature": 0.5}, SamplingOptions(max_tokens=9, stop=(".",)))


def test_a_programs_first_call_is_found_without_the_model():
    assert chat._first_prompt({"question": "q", "temperature": 0}) == Prompt(
        (("system", "Be brief."), ("user", "q")), "")
    assert doc_then_fork._first_prompt({"doc": "d"}) == Prompt(None, "Doc: d")
    assert chat._first_prompt({"question": "q"}) is None  # the program fails (a missing argument): no prompt


def test_gen_is_an_expression_with_its_options():
    g = gen("g", max_tokens=3, stop=["a", "b"], top_k=5)
    assert g == Gen("g", SamplingOptions(max_tokens=3, stop=("a", "b"), top_k=5), None)
