"""Admission control: how many requests, and how many prompt tokens, may wait for their first token at once.

A request holds a `Ticket` from admission (after tokenizing) until its first token or its end, whichever comes
first. Past either bound `admit` raises `Overloaded` at once, so an overloaded router answers RESOURCE_EXHAUSTED in
microseconds instead of queueing work it cannot start (a queued request pins an L2 lease, memory and a stream).
Pure: no I/O; called on the event loop only.
"""

from __future__ import annotations


class Overloaded(Exception):
    """The message says which bound was hit."""


class Ticket:
    """One admitted request's share of the bounds; `done()` returns it (idempotent)."""

    __slots__ = ("_admission", "tokens")

    def __init__(self, admission: Admission, tokens: int) -> None:
        self._admission: Admission | None = admission
        self.tokens = tokens

    def done(self) -> None:
        if self._admission is not None:
            self._admission._leave(self)
            self._admission = None


class Admission:
    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.requests = 0
        self.tokens = 0

    def admit(self, tokens: int) -> Ticket:
        """A ticket for a request of `tokens` prompt tokens; raises `Overloaded` past a bound (a request alone may
        exceed the token bound: it is admitted when nothing else waits)."""
        if self.requests >= self.max_requests:
            raise Overloaded(f"{self.requests} requests are waiting for their first token (--max-pending-requests)")
        if self.requests and self.tokens + tokens > self.max_tokens:
            raise Overloaded(f"{self.tokens} prompt tokens are waiting; {tokens} more would pass "
                             f"--max-pending-tokens {self.max_tokens}")
        self.requests += 1
        self.tokens += tokens
        return Ticket(self, tokens)

    def _leave(self, ticket: Ticket) -> None:
        self.requests -= 1
        self.tokens -= ticket.tokens
