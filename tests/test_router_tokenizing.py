"""The router tokenizes off its event loop on two lanes (`TokenizerLanes`): each lane one call at a time, a long
prompt on its own lane so that short requests never wait behind it; validation errors pass through as they are."""

from __future__ import annotations

import asyncio
import threading

import pytest

from radixserve.server import ServiceError
from radixserve.v1 import router_pb2
from router.admission import Admission
from router.service import Router
from router.tokenizer import SHORT_REQUEST_BYTES, TokenizerLanes
from router.validation import Limits

LIMITS = Limits(vocab_size=100, max_context=64_000, max_new_tokens=16, max_input_chars=100_000, max_stop_strings=4)


class RecordingTokenizer:
    """Stands in for `PromptTokenizer`: one id per character, noting the thread and the overlap of its calls; a
    call for a text longer than `SHORT_REQUEST_BYTES` waits for `release`."""

    def __init__(self) -> None:
        self.threads: set[str] = set()
        self.in_call = self.most_in_call = 0
        self._lock = threading.Lock()
        self.release = threading.Event()

    def encode_text(self, text: str) -> list[int]:
        with self._lock:
            self.in_call += 1
            self.most_in_call = max(self.most_in_call, self.in_call)
        self.threads.add(threading.current_thread().name)
        if len(text) > SHORT_REQUEST_BYTES:
            assert self.release.wait(10), "the long prompt was never released"
        threading.Event().wait(0.01)  # long enough for calls to overlap if they could
        with self._lock:
            self.in_call -= 1
        return [ord(c) % 100 for c in text]


def router_over(short: RecordingTokenizer, long: RecordingTokenizer) -> Router:
    return Router(pool=None, tokenizers=TokenizerLanes(short, long), limits=LIMITS, matcher=None,
                  admission=Admission(1, 1))


def test_tokenizing_runs_off_the_event_loop_one_call_at_a_time():
    short = RecordingTokenizer()
    router = router_over(short, RecordingTokenizer())

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(router.tokenize(router_pb2.TokenizeRequest(text=f"prompt {i}"))
                                      for i in range(4)))

    assert asyncio.run(main()) == [[ord(c) % 100 for c in f"prompt {i}"] for i in range(4)]
    assert threading.main_thread().name not in short.threads and len(short.threads) == 1
    assert short.most_in_call == 1


def test_short_requests_never_wait_behind_a_long_prompt():
    short, long = RecordingTokenizer(), RecordingTokenizer()
    router = router_over(short, long)

    async def main() -> tuple[list[list[int]], bool]:
        stuck = asyncio.ensure_future(router.tokenize(router_pb2.TokenizeRequest(text="x" * (SHORT_REQUEST_BYTES + 1))))
        answered = await asyncio.gather(*(router.tokenize(router_pb2.TokenizeRequest(text=f"q{i}")) for i in range(8)))
        still_running = not stuck.done()  # the short ones finished while the long one was held
        long.release.set()
        await stuck
        return answered, still_running

    answered, long_was_running = asyncio.run(main())
    assert answered == [[ord(c) % 100 for c in f"q{i}"] for i in range(8)] and long_was_running
    assert short.threads.isdisjoint(long.threads) and long.most_in_call == 1


def test_validation_errors_pass_through_the_tokenizing_thread():
    router = router_over(RecordingTokenizer(), RecordingTokenizer())
    with pytest.raises(ServiceError, match="must not be empty"):
        asyncio.run(router.tokenize(router_pb2.TokenizeRequest(text="")))
