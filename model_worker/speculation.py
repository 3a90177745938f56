"""Prompt-lookup drafts for greedy decoding: guesses of the next tokens, taken from the sequence's own text.

A sequence's last n tokens (n = `MAX_NGRAM` down to 1, longest first) are looked up among its earlier tokens; the
tokens that followed their latest earlier occurrence are the draft. The engine verifies a draft in the next decode
(`Engine._verify`): a draft token is kept only where it equals the greedy choice, so the output is greedy decoding's
whatever the guess. On these CPUs a decode step is bound by reading the weights, so a few more rows cost little
(the model's linears at 4, 12 and 16 rows: 11.4, 12.4 and 13.5 ms; AMD EPYC, 2 cores), and the bench corpus's
greedy continuations took 1.29-1.33 tokens a step with drafts of up to 2 tokens (8-16 prompts each of the
no-reuse, shared-prefix and multi-turn workloads, 16 tokens each).

It is off by default (`--speculative-tokens 0`): a batch's sequences then end apart, and the next requests'
prefills run beside the others' decodes. The no-reuse workload through the stack (4 in flight, 16 tokens, 3
alternating pairs of runs), 2 tokens against none: TTFT mean 396-450 against 579-633 ms and 3.97-4.67 against
3.81-4.33 req/s, but 29.5-35.6 against 22.8-27.9 ms between tokens.
"""

from __future__ import annotations

MAX_NGRAM = 4


class NgramDrafter:
    """The draft index of one sequence. `propose(tokens, k)`: up to `k` tokens after the latest earlier occurrence
    of the longest of `tokens`' last 4, 3, 2 or 1 tokens found earlier in `tokens`; empty when none is. `tokens`
    must extend the previous call's (a sequence's tokens only grow); each call indexes only what was added (a
    2,000-token prompt: 3.3 ms once, then ~5 us a token)."""

    def __init__(self) -> None:
        # _follows[n - 1][the n tokens ending before position e] = e, the latest such e: tokens[e] followed them
        self._follows: list[dict[tuple[int, ...], int]] = [{} for _ in range(MAX_NGRAM)]
        self._indexed = 1  # the positions e < _indexed are in the index (position 0 follows nothing)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        end = len(tokens)
        # the tail ends at `end`, which is never indexed: a lookup finds an earlier occurrence
        for e in range(self._indexed, end):
            for n in range(1, min(MAX_NGRAM, e) + 1):
                self._follows[n - 1][tuple(tokens[e - n:e])] = e
        self._indexed = max(self._indexed, end)
        if k <= 0:
            return []
        for n in range(min(MAX_NGRAM, end), 0, -1):
            e = self._follows[n - 1].get(tuple(tokens[end - n:]))
            if e is not None:
                return tokens[e:e + k]
        return []
