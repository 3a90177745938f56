"""A program state's text as the server sees it, and what a model call at its end sends. Pure, no I/O.

A transcript is plain text (no role segment ever) or chat (every piece inside a role segment: the router applies
the model's chat template, so text outside a turn has no place in the prompt). A model call is only possible in
plain text, or inside an `assistant` segment; there it continues that turn:

    chat:   messages = the completed turns, the generation prompt added by the router ── then `partial`, the
            assistant turn's content so far ("" right after `assistant(`), then the call's output
    plain:  text = everything so far ── then the call's output
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

Turn = tuple[str, str]  # (role, content)


@dataclass(frozen=True)
class Prompt:
    """What a model call sends: `text` alone when `turns` is None, else the chat `turns` with the generation prompt
    and `text` after it (the open assistant turn's content so far)."""

    turns: tuple[Turn, ...] | None
    text: str


@dataclass(frozen=True)
class Transcript:
    """Immutable: every method returns a new transcript. `open_role` is the role segment being appended to."""

    turns: tuple[Turn, ...] = ()
    open_role: str | None = None
    partial: str = ""   # plain: all the text; chat: the open turn's content

    @property
    def chat(self) -> bool:
        return bool(self.turns) or self.open_role is not None

    def append(self, text: str) -> Transcript:
        if self.chat and self.open_role is None:
            raise ValueError("text outside a role segment in a chat program: put it in system(), user() or "
                             "assistant() (the router applies the chat template)")
        return replace(self, partial=self.partial + text)

    def begin(self, role: str) -> Transcript:
        if self.open_role is not None:
            raise ValueError(f"{role}() inside {self.open_role}(): role segments do not nest")
        if self.partial:
            raise ValueError(f"{role}() after plain text: a program is plain text or chat turns, not both")
        return replace(self, open_role=role)

    def end(self) -> Transcript:
        return Transcript(self.turns + ((self.open_role, self.partial),))

    def prompt(self) -> Prompt:
        """The prompt of a model call appended here; ValueError where none can be."""
        if not self.chat:
            if not self.partial:
                raise ValueError("a model call needs some prompt text before it")
            return Prompt(None, self.partial)
        if self.open_role != "assistant":
            raise ValueError("in a chat program, gen and select go inside assistant(...)")
        return Prompt(self.turns, self.partial)

    def fork_prompts(self) -> list[Prompt]:
        """Prompts whose common token prefix is what every continuation of this transcript shares: the turns so
        far (seen before a generation prompt, and before one more turn), or the text so far (less a last token
        that more text would merge with)."""
        if not self.chat:
            return [Prompt(None, self.partial), Prompt(None, self.partial + " .")] if self.partial else []
        return [Prompt(self.turns, ""), Prompt(self.turns + (("user", "."),), "")] if self.turns else []

    def messages(self) -> list[dict[str, str]]:
        """The turns as chat messages, the open one included."""
        turns = self.turns + (((self.open_role, self.partial),) if self.open_role else ())
        return [{"role": role, "content": content} for role, content in turns]

    def text(self) -> str:
        """Plain: the prompt text. Chat: the turns' contents, one per line (the template's markup is the
        router's)."""
        return self.partial if not self.chat else "\n".join(m["content"] for m in self.messages())


def common_prefix(sequences: Sequence[Sequence[int]]) -> list[int]:
    """The longest prefix all `sequences` share ([] for none)."""
    if not sequences:
        return []
    first, n = sequences[0], min(len(s) for s in sequences)
    for i in range(n):
        if any(s[i] != first[i] for s in sequences):
            return list(first[:i])
    return list(first[:n])


def choice_score(logprobs: Sequence[float]) -> float:
    """A choice's score: the mean logprob of its tokens given the prompt (SGLang's default,
    token_length_normalized), so a longer choice is not penalized for its length."""
    return sum(logprobs) / len(logprobs)


def best_choice(scores: Sequence[float]) -> int:
    """The index of the highest score; the first of equal ones."""
    return max(range(len(scores)), key=lambda i: (scores[i], -i))
