"""Incremental detokenization into valid UTF-8 text deltas, and stop strings.

`IncrementalDetokenizer` uses the prefix/read-offset technique (as in TGI and vLLM): decode a short window of
recent tokens twice — up to the read offset and up to the end — and emit the difference, unless it ends in U+FFFD
(an incomplete multi-byte character, held until the next token completes it). Deltas, followed by `flush()` when
the sequence ends, concatenate to `tokenizer.decode(all_ids, skip_special_tokens=True)` for byte-level BPE
tokenizers.

`StopStringFilter` cuts the text at the first stop string (the stop string itself is not emitted) and holds back
any tail that could still become the start of a stop string.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Feed token ids one by one; each call returns the new text (possibly empty)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the window decoded for context
        self._read_offset = 0  # tokens before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end), for when the sequence ends."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]


class StopStringFilter:
    """Feed text deltas; `push` returns (text safe to emit, whether a stop string was hit)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def push(self, delta: str) -> tuple[str, bool]:
        """Text to emit now; after a hit the text up to (not including) the earliest stop string, and True."""
        text = self._held + delta
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return text[:min(hits)], True
        keep = self._hold_length(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """The held-back tail, for when the sequence ends for another reason."""
        text, self._held = self._held, ""
        return text

    def _hold_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for length in range(min(len(text), max((len(s) for s in self._stops), default=1) - 1), 0, -1):
            suffix = text[-length:]
            if any(s.startswith(suffix) for s in self._stops):
                return length
        return 0
