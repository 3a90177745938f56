"""Turns text and chat messages into prompt token ids, as the served model expects them."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenizers import decoders
from transformers import AutoTokenizer

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


class PromptTokenizer:
    """The model's own tokenizer and chat template, loaded from the worker's model directory."""

    def __init__(self, model_dir: Path | str):
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if self._tokenizer.chat_template is None:
            raise ValueError(f"{model_dir} has no chat template; messages cannot be served")
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        self._byte_level = isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)

    def encode_text(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=True)

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Applies the chat template with the generation prompt (the assistant turn is open)."""
        rendered = self._tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                                       tokenize=False, add_generation_prompt=True)
        return self._tokenizer.encode(rendered, add_special_tokens=False)

    def token_strings(self, ids: Sequence[int]) -> list[tuple[str, bytes]]:
        """Each token's text alone (U+FFFD for the part of a character it holds, as `decode` shows it) and its
        bytes: the token's own UTF-8 bytes in a byte-level BPE (part of a character's too), else its text's."""
        strings = []
        for token in self._tokenizer.convert_ids_to_tokens(list(ids)):
            text = self._tokenizer.convert_tokens_to_string([token])
            own = self._byte_level and all(c in _BYTE_OF for c in token)
            strings.append((text, bytes(_BYTE_OF[c] for c in token) if own else text.encode()))
        return strings


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: each byte's printable stand-in character, to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_OF = _byte_level_alphabet()


# Requests up to this many bytes tokenize in about a millisecond; the largest one accepted (--max-input-chars,
# 262,144 characters) in about 0.3 s here.
SHORT_REQUEST_BYTES = 16 << 10


class TokenizerLanes:
    """Two tokenizing threads, each with its own tokenizer (one is not safe for concurrent calls; two tokenize in
    parallel, the GIL released): requests up to `SHORT_REQUEST_BYTES` on the short lane, larger ones on the long
    lane, so that a long prompt delays only other long ones, and no request ever waits behind it to be tokenized."""

    def __init__(self, short: PromptTokenizer, long: PromptTokenizer):
        """`short` and `long`: two instances of the same tokenizer (`load`)."""
        self._short = (ThreadPoolExecutor(1, thread_name_prefix="tokenize-short"), short)
        self._long = (ThreadPoolExecutor(1, thread_name_prefix="tokenize-long"), long)

    @classmethod
    def load(cls, model_dir: Path | str) -> TokenizerLanes:
        return cls(PromptTokenizer(model_dir), PromptTokenizer(model_dir))

    def lane(self, request_bytes: int) -> tuple[ThreadPoolExecutor, PromptTokenizer]:
        """The thread to tokenize a request of `request_bytes` on, and the tokenizer that thread owns."""
        return self._short if request_bytes <= SHORT_REQUEST_BYTES else self._long
