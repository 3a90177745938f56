"""Constrained decoding on xgrammar: a `Constraint` compiles (once, cached) to a grammar over the model's vocabulary;
each constrained sequence walks it with its own matcher, and a batch's token bitmask masks the logits before
sampling.

Contracts:
- `Grammars.compile` may be called from any thread and is meant to run off the engine's step thread (the worker's
  service compiles on its own thread before the request is queued). It raises ValueError with the compiler's message
  for a bad spec. Compilations are serialized, and the last `capacity` grammars used are kept, keyed by the
  constraint (kind and text): a repeated spec compiles once.
- A matcher (`new_matcher`) belongs to one sequence and is used only under the engine lock: `fill` it into the
  mask before sampling, `accept_token` the token sampled. Its stop tokens are the model's end-of-sequence ids, so it
  allows EOS exactly where the grammar is complete, and accepting EOS terminates it.
- `TokenMask.apply` sets the logits of disallowed tokens to -inf in place: check finiteness before it.

The vocabulary handed to xgrammar is the model's (`vocab_size`, the logits' width, which may exceed the tokenizer's:
padded rows are special to xgrammar and always masked). JSON is compact (no free whitespace: a small model left
free to emit whitespace can spend its whole budget on newlines).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import jsonschema
import torch
import xgrammar as xgr

from model_worker.request import Constraint, ConstraintKind

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept; each holds per-state token masks, mostly well under 1 MiB
COMPILER_THREADS = 2  # xgrammar's threads per compilation; these hosts have 2 cores, shared with the engine
# xgrammar prefixes its messages with a time and a C++ source location, and echoes the whole input after some
_COMPILER_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class Grammars:
    """Compiles constraints for one model's vocabulary, with an LRU of compiled grammars."""

    def __init__(self, tokenizer: object, vocab_size: int, stop_token_ids: tuple[int, ...],
                 capacity: int = GRAMMAR_CACHE_SIZE) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILER_THREADS, cache_enabled=False)
        self._cache: OrderedDict[Constraint, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._capacity = capacity
        self.compilations = 0  # grammars compiled so far (cache misses)

    def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        """The compiled grammar of `constraint`; ValueError (naming the field) when it is not a valid spec."""
        with self._lock:
            if constraint in self._cache:
                self._cache.move_to_end(constraint)
                return self._cache[constraint]
            compiled = self._compile(constraint)
            self.compilations += 1
            self._cache[constraint] = compiled
            if len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        kind, spec = constraint.kind, constraint.spec
        try:
            if kind is ConstraintKind.REGEX:
                return self._compiler.compile_regex(spec)
            if kind is ConstraintKind.JSON_SCHEMA:
                _check_schema(spec)
                return self._compiler.compile_json_schema(spec, any_whitespace=False)
            return self._compiler.compile_grammar(spec if kind is ConstraintKind.GRAMMAR else choices_ebnf(spec))
        except RuntimeError as e:  # xgrammar reports every bad input so
            raise ValueError(f"sampling.{kind.value} does not compile: {compiler_message(e)}") from None


def new_matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
    """A matcher at the start of `compiled`, for one sequence."""
    return xgr.GrammarMatcher(compiled)


def _check_schema(spec: str) -> None:
    """ValueError unless `spec` is JSON text holding a JSON schema (by its meta-schema, the latest draft by default)."""
    try:
        schema = json.loads(spec)
    except ValueError as e:
        raise ValueError(f"sampling.json_schema is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError("sampling.json_schema is nested too deeply") from None
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"sampling.json_schema is not a JSON schema: {e.message}") from None
    except RecursionError:
        raise ValueError("sampling.json_schema is nested too deeply") from None


def choices_ebnf(choices: tuple[str, ...]) -> str:
    """A grammar matching exactly one of `choices`; JSON string escapes are also xgrammar's EBNF literal escapes."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def compiler_message(error: RuntimeError) -> str:
    """xgrammar's message without its time, source location and echo of the input."""
    return _COMPILER_NOISE.sub("", str(error).strip()).split(" The JSON string is:")[0].strip()


class TokenMask:
    """One token bitmask for a batch of up to `max_rows` sampled rows over `vocab_size` tokens."""

    def __init__(self, max_rows: int, vocab_size: int) -> None:
        self._bitmask = xgr.allocate_token_bitmask(max_rows, vocab_size)
        self._vocab_size = vocab_size

    def apply(self, logits: torch.Tensor, rows: list[tuple[int, xgr.GrammarMatcher]]) -> None:
        """Masks, in place, row i of `logits` to the tokens its matcher allows next, for each (i, matcher)."""
        for i, matcher in rows:
            matcher.fill_next_token_bitmask(self._bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, self._bitmask.to(logits.device), vocab_size=self._vocab_size,
                                        indices=[i for i, _ in rows])
