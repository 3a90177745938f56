"""Background threads run at a lower CPU priority than the threads serving requests (`radixserve.priority`)."""

import os
import threading

import pytest

from radixserve.priority import (BACKGROUND_NICE, can_leave_idle, idle_current_thread, lower_current_thread_priority,
                                 normal_thread)


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priorities here")
def test_only_the_calling_thread_is_lowered():
    seen = {}

    def background() -> None:
        lower_current_thread_priority()
        seen["background"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    if before != 0:
        pytest.skip(f"the tests run at nice {before}, not 0")
    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert seen["background"] == BACKGROUND_NICE
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE here")
def test_idle_thread_runs_under_sched_idle_and_the_caller_does_not():
    seen = {}

    def background() -> None:
        idle_current_thread()
        seen["background"] = os.sched_getscheduler(threading.get_native_id())

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert seen["background"] == os.SCHED_IDLE
    assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not can_leave_idle(), reason="no SCHED_IDLE, or no way back here")
def test_an_idle_thread_comes_back_to_normal_scheduling_at_nice_0():
    seen = {}

    def background() -> None:
        lower_current_thread_priority()
        idle_current_thread()
        seen["idle"] = os.sched_getscheduler(0)
        seen["back"] = normal_thread()
        seen["after"] = os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert seen == {"idle": os.SCHED_IDLE, "back": True, "after": (os.SCHED_OTHER, 0)}
