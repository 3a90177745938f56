"""CPU priority of background threads: work off every request's critical path yields the cores under load.

On 2 cores the worker's forward keeps both busy with its OpenMP team, and a parallel region ends only when each of
its threads has done its share: a thread of another process that takes a core stalls the whole forward. kvcached's
L3 writer (checksums and LMDB writes of every committed block) is such a thread, yet nothing waits for it: it runs at
`BACKGROUND_NICE`. (The worker's kvcached client thread does not: it also re-registers the worker after a kvcached
restart.)
"""

from __future__ import annotations

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
