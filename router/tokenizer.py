"""Turns text and chat messages into prompt token ids, as the served model expects them."""

from __future__ import annotations

from collections.abc import Sequence
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
