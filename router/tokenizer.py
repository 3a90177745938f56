"""Turns text and chat messages into prompt token ids, as the served model expects them."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from transformers import AutoTokenizer

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


class PromptTokenizer:
    """The model's own tokenizer and chat template, loaded from the worker's model directory."""

    def __init__(self, model_dir: Path | str):
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if self._tokenizer.chat_template is None:
            raise ValueError(f"{model_dir} has no chat template; messages cannot be served")

    def encode_text(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=True)

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Applies the chat template with the generation prompt (the assistant turn is open)."""
        rendered = self._tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                                       tokenize=False, add_generation_prompt=True)
        return self._tokenizer.encode(rendered, add_special_tokens=False)


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
