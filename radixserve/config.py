"""One frozen config dataclass per process drives its command line.

Each field becomes a flag: `--field-name`, its default from the field, its help from `field(metadata={"help": ...})`.
`str` Enums become closed choices; `tuple[str, ...]` fields become repeatable flags; `bool` fields become switches.
Validation lives in the dataclass's `__post_init__` and raises `ValueError`; the CLI turns that into a usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import typing
from pathlib import Path
from typing import Any, TypeVar

C = TypeVar("C")


class Choice(str, enum.Enum):
    """A closed choice of a config field: its flag offers exactly the values, and it prints as its value."""

    def __str__(self) -> str:
        return self.value


def cache_root() -> Path:
    """Where converted models and the disk tier live: `$RADIXSERVE_CACHE`, default `~/.cache/radixserve`."""
    return Path(os.environ.get("RADIXSERVE_CACHE", Path.home() / ".cache" / "radixserve"))


def setting(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with a help text for its flag."""
    return dataclasses.field(default=default, metadata={"help": help, **kw})


def _add_flag(parser: argparse.ArgumentParser, f: dataclasses.Field, hint: Any) -> None:
    flag = "--" + f.name.replace("_", "-")
    help_text = f.metadata.get("help", "")
    if hint is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        parser.add_argument(flag, type=hint, choices=list(hint), default=f.default,
                            help=f"{help_text} (default: {f.default.value})")
    elif typing.get_origin(hint) is tuple:
        parser.add_argument(flag, action="append", type=typing.get_args(hint)[0], default=None,
                            help=f"{help_text} (repeatable; default: {' '.join(map(str, f.default)) or 'none'})")
    else:
        parser.add_argument(flag, type=hint, default=f.default, help=f"{help_text} (default: {f.default})")


def parse_config(cls: type[C], argv: list[str] | None = None, description: str = "") -> C:
    """Builds `cls` from the command line; a `ValueError` from validation becomes a usage error (exit 2)."""
    parser = argparse.ArgumentParser(description=description or cls.__doc__)
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    for f in fields:
        _add_flag(parser, f, hints[f.name])
    args = vars(parser.parse_args(argv))
    values = {f.name: args[f.name] for f in fields if args[f.name] is not None}
    for f in fields:
        if typing.get_origin(hints[f.name]) is tuple and f.name in values:
            values[f.name] = tuple(values[f.name])
    try:
        return cls(**values)
    except ValueError as e:
        parser.error(str(e))
