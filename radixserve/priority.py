"""CPU priority of background threads: work off every request's critical path yields the cores under load.

On 2 cores the worker's forward keeps both busy with its OpenMP team, and a parallel region ends only when each of
its threads has done its share: a thread of another process that takes a core stalls the whole forward. kvcached's
L3 writer (checksums and LMDB writes of every committed block) is such a thread, yet nothing waits for it: it runs
on idle cores until its work turns urgent, then at normal priority (`DiskTier`), or at `BACKGROUND_NICE` all along
where a thread cannot leave SCHED_IDLE again. (The worker's kvcached client thread does not: it also re-registers
the worker after a kvcached restart.) Populating a shared-memory segment's page tables
(`SlabSegment.populate_in_background`) runs only on idle cores (`idle_current_thread`).

Such a thread must keep its system calls short. A kernel built `PREEMPT_NONE` (these hosts) preempts a thread only
when it leaves the kernel, and the scheduler places a woken thread on a core that runs only SCHED_IDLE work as on an
idle one: the woken thread waits there for the idle thread's system call to return (up to 12 ms behind an L3
commit of 16 blocks, so the writer commits one block at a time: `DiskTier`); a populate call covers 2 MiB.
"""

from __future__ import annotations

import functools
import os
import threading

BACKGROUND_NICE = 10  # CFS gives a nice-10 thread about a tenth of a nice-0 thread's share of a contended core


def lower_current_thread_priority() -> None:
    """Lowers the calling thread's CPU priority to `BACKGROUND_NICE` (Linux schedules threads one by one; raising
    a nice value needs no privilege). A platform without per-thread priorities leaves it as it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass


def idle_current_thread() -> None:
    """Runs the calling thread only when a core would otherwise idle (Linux's SCHED_IDLE: any other thread that
    wakes preempts it as soon as it is out of a system call (module docstring), where a nice-19 thread may hold the
    core for a scheduler tick). A platform without it leaves the thread as it is."""
    try:
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def normal_thread(native_id: int | None = None, nice: int = 0) -> bool:
    """Returns a thread of this process (the calling one by default) from SCHED_IDLE to normal scheduling at `nice`,
    for background work that has turned urgent; False where that is refused (leaving SCHED_IDLE at nice 0 needs
    CAP_SYS_NICE or an RLIMIT_NICE of 20: Docker's default capabilities lack the first) or there are no per-thread
    policies. Another thread's call takes effect at once, even while the thread is inside a system call."""
    tid = threading.get_native_id() if native_id is None else native_id
    try:
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (AttributeError, OSError):
        return False
    return True


@functools.cache
def can_leave_idle() -> bool:
    """Whether a thread of this process may leave SCHED_IDLE again (`normal_thread`): tried once, on a
    throwaway thread, so that no thread that must come back is left idle for good."""
    left = []

    def trial() -> None:
        if hasattr(os, "SCHED_IDLE"):
            idle_current_thread()
            left.append(os.sched_getscheduler(0) == os.SCHED_IDLE and normal_thread())

    thread = threading.Thread(target=trial, name="priority-trial")
    thread.start()
    thread.join()
    return bool(left and left[0])
