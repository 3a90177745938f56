import pytest

from model_worker.detokenizer import IncrementalDetokenizer, StopStringFilter

TEXTS = ["Hello, world! The capital of France is Paris.", "emoji 😀🎉 and 👩‍👩‍👧 family", "中文测试：你好，世界。日本語も。",
         "naïve café — “quotes” …\nnew line\ttab", "ok 🙂"]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode_without_broken_chars(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    if any("\ufffd" in tokenizer.decode([i]) for i in ids):
        assert "" in deltas  # a character split over tokens was held back until complete


def test_flush_emits_an_incomplete_tail(tokenizer):
    ids = tokenizer("a😀", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.add(i) for i in ids[:-1])
    assert text + detok.flush() == tokenizer.decode(ids[:-1])
    assert detok.flush() == ""


def test_special_tokens_are_not_emitted(tokenizer):
    ids = tokenizer("Hi", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add(i) for i in ids) == "Hi"


@pytest.mark.parametrize("deltas, stops, emitted, hit", [
    (["Hello", " wor", "ld"], ("world",), ["Hello", " ", ""], True),
    (["ab", "c", "d"], ("cx",), ["ab", "", "cd"], False),
    (["xSTO", "P here"], ("STOP",), ["x", ""], True),
    (["a", "b"], (), ["a", "b"], False),
    (["one two"], ("two", "one"), [""], True),
    (["ab"], ("b", "abc"), ["a"], True),
])
def test_stop_strings(deltas, stops, emitted, hit):
    stop_filter = StopStringFilter(stops)
    results = [stop_filter.push(d) for d in deltas]
    assert [text for text, _ in results] == emitted
    assert results[-1][1] is hit
    assert [h for _, h in results[:-1]] == [False] * (len(deltas) - 1)


def test_held_text_is_flushed_when_not_a_stop():
    stop_filter = StopStringFilter(("END",))
    assert stop_filter.push("the E") == ("the ", False)
    assert stop_filter.flush() == "E"
    assert stop_filter.flush() == ""
