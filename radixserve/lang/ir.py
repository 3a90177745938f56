"""What a program appends to its state: text, role segments, `gen` and `select` calls. Pure data, no I/O.

An expression is a string or an `Expr`; `+` concatenates them (`"Answer: " + gen("a")`). `flatten` turns one into
the ordered operations the interpreter runs: `Text`, `RoleBegin`, `RoleEnd`, `Gen`, `Select`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields


class Expr:
    """Anything a state can be appended with (`s += expr`)."""

    def __add__(self, other: Expr | str) -> Concat:
        return Concat((self, other))

    def __radd__(self, other: str) -> Concat:
        return Concat((other, self))


@dataclass(frozen=True)
class Text(Expr):
    text: str


@dataclass(frozen=True)
class Concat(Expr):
    parts: tuple[Expr | str, ...]


@dataclass(frozen=True)
class Role(Expr):
    """One chat turn: `role` ∈ system, user, assistant; its content may hold `gen` and `select`."""

    role: str
    content: Expr | str


@dataclass(frozen=True)
class RoleBegin:
    role: str


@dataclass(frozen=True)
class RoleEnd:
    pass


@dataclass(frozen=True)
class SamplingOptions:
    """A `gen`'s sampling; None: the run's default, else the server's."""

    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None

    def over(self, defaults: SamplingOptions) -> SamplingOptions:
        """These options, each unset one taken from `defaults`."""
        return SamplingOptions(**{f.name: getattr(self, f.name) if getattr(self, f.name) not in (None, ())
                                  else getattr(defaults, f.name) for f in fields(self)})


@dataclass(frozen=True)
class Constraint:
    """At most one of the server's structured-output constraints; `kind` is the SamplingParams field."""

    kind: str      # "regex", "json_schema" or "choices"
    spec: str | tuple[str, ...]


@dataclass(frozen=True)
class Gen(Expr):
    name: str | None
    sampling: SamplingOptions
    constraint: Constraint | None


@dataclass(frozen=True)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]


Op = Text | RoleBegin | RoleEnd | Gen | Select


def flatten(expr: Expr | str) -> list[Op]:
    """The operations `expr` stands for, in order."""
    if isinstance(expr, str):
        return [Text(expr)]
    if isinstance(expr, Concat):
        return [op for part in expr.parts for op in flatten(part)]
    if isinstance(expr, Role):
        return [RoleBegin(expr.role), *flatten(expr.content), RoleEnd()]
    if isinstance(expr, Text | Gen | Select):
        return [expr]
    raise TypeError(f"cannot append {type(expr).__name__} to a program state")


# -- the constructors programs call (SGLang's names) --------------------------------------------------------------
def system(content: Expr | str = "") -> Role:
    return Role("system", content)


def user(content: Expr | str = "") -> Role:
    return Role("user", content)


def assistant(content: Expr | str = "") -> Role:
    return Role("assistant", content)


def gen(name: str | None = None, max_tokens: int | None = None, stop: str | list[str] | None = None,
        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        seed: int | None = None, regex: str | None = None, json_schema: str | dict | None = None,
        choices: list[str] | None = None) -> Gen:
    """Generates into `s[name]`. At most one of `regex`, `json_schema` (a dict or its JSON text) and `choices`:
    the server's constrained decoding, token by token (`select` ranks whole choices instead)."""
    constraints = [Constraint(kind, spec) for kind, spec in (
        ("regex", regex), ("json_schema", json_schema if json_schema is None or isinstance(json_schema, str)
                           else json.dumps(json_schema)), ("choices", None if choices is None else tuple(choices)))
        if spec is not None]
    if len(constraints) > 1:
        raise ValueError("gen takes at most one of regex, json_schema and choices")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return Gen(name, SamplingOptions(max_tokens, stops, temperature, top_p, top_k, seed),
               constraints[0] if constraints else None)


def select(name: str | None = None, choices: list[str] | None = None) -> Select:
    """Appends the choice the model scores highest after the prompt (see `scoring`), into `s[name]`."""
    if not choices:
        raise ValueError("select needs at least one choice")
    return Select(name, tuple(choices))
