"""The router tokenizes off its event loop, one call at a time, and keeps validation errors as they are."""

from __future__ import annotations

import asyncio
import threading

import pytest

from radixserve.server import ServiceError
from radixserve.v1 import router_pb2
from router.admission import Admission
from router.service import RouterServicer
from router.validation import Limits

LIMITS = Limits(vocab_size=100, max_context=64, max_new_tokens=16, max_input_chars=1000, max_stop_strings=4)


class RecordingTokenizer:
    """Stands in for `PromptTokenizer`: one id per character, noting the thread and the overlap of its calls."""

    def __init__(self) -> None:
        self.threads: set[str] = set()
        self.in_call = self.most_in_call = 0
        self._lock = threading.Lock()

    def encode_text(self, text: str) -> list[int]:
        with self._lock:
            self.in_call += 1
            self.most_in_call = max(self.most_in_call, self.in_call)
        self.threads.add(threading.current_thread().name)
        threading.Event().wait(0.01)  # long enough for calls to overlap if they could
        with self._lock:
            self.in_call -= 1
        return [ord(c) % 100 for c in text]


def test_tokenizing_runs_off_the_event_loop_one_call_at_a_time():
    tokenizer = RecordingTokenizer()
    servicer = RouterServicer(pool=None, tokenizer=tokenizer, limits=LIMITS, matcher=None, admission=Admission(1, 1))

    async def main() -> list[router_pb2.TokenizeResponse]:
        requests = [router_pb2.TokenizeRequest(text=f"prompt {i}") for i in range(4)]
        return await asyncio.gather(*(servicer.Tokenize(r, None) for r in requests))

    responses = asyncio.run(main())
    assert [list(r.token_ids) for r in responses] == [[ord(c) % 100 for c in f"prompt {i}"] for i in range(4)]
    assert threading.main_thread().name not in tokenizer.threads and len(tokenizer.threads) == 1
    assert tokenizer.most_in_call == 1


def test_validation_errors_pass_through_the_tokenizing_thread():
    servicer = RouterServicer(pool=None, tokenizer=RecordingTokenizer(), limits=LIMITS, matcher=None,
                              admission=Admission(1, 1))
    with pytest.raises(ServiceError, match="must not be empty"):
        asyncio.run(servicer.Tokenize(router_pb2.TokenizeRequest(text=""), None))
