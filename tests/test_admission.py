"""The router's admission bounds (pure)."""

from __future__ import annotations

import pytest

from router.admission import Admission, Overloaded


def test_requests_are_bounded_and_a_ticket_returns_its_share_once():
    admission = Admission(max_requests=2, max_tokens=1000)
    first, second = admission.admit(10), admission.admit(20)
    with pytest.raises(Overloaded, match="2 requests are waiting"):
        admission.admit(1)
    first.done()
    first.done()  # idempotent
    assert (admission.requests, admission.tokens) == (1, 20)
    admission.admit(1)
    second.done()
    assert (admission.requests, admission.tokens) == (1, 1)


def test_tokens_are_bounded_but_a_lone_request_may_exceed_them():
    admission = Admission(max_requests=10, max_tokens=100)
    big = admission.admit(500)  # nothing else waits: it runs rather than never
    with pytest.raises(Overloaded, match="500 prompt tokens are waiting; 1 more would pass --max-pending-tokens 100"):
        admission.admit(1)
    big.done()
    admission.admit(60)
    with pytest.raises(Overloaded):
        admission.admit(41)
    admission.admit(40)
    assert (admission.requests, admission.tokens) == (2, 100)
