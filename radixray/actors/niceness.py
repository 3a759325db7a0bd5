"""Scheduling priority of an engine worker's threads.

Ray starts its worker processes at niceness 15 (raylet option ``worker_niceness``), while
its own daemons and any client on the node run at 0. A forward pass splits every op over
OpenMP threads that meet at barriers: when one of them waits behind a niceness-0 process,
the others wait too. On a 2-vCPU node the EngineWorker used 1.23 of 2 cores during a
batch-32 run with ~0.4 cores idle; with the worker at niceness 0 the same run gave ~7%
more output tokens per second (docs/benchmarks.md).
"""

from __future__ import annotations

import os


def thread_ids() -> list[int]:
    """The kernel ids of this process's threads (Linux), or just the process id elsewhere."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [os.getpid()]


def set_niceness(target: int) -> tuple[int, str | None]:
    """Move every thread of this process whose niceness differs from ``target`` to it.

    Threads started later inherit the niceness of the thread that starts them, so call
    this before the engine starts its threads (and again after, for any started in
    between). Returns (threads changed, the error that stopped it or None): raising a
    thread's priority needs CAP_SYS_NICE or a matching RLIMIT_NICE, and without them
    nothing is changed and the error says so.
    """
    changed = 0
    for tid in thread_ids():
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != target:
                os.setpriority(os.PRIO_PROCESS, tid, target)
                changed += 1
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except PermissionError as exc:
            return changed, (f"cannot set niceness {target} ({exc.strerror}); the worker keeps "
                             f"Ray's; start Ray with RAY_worker_niceness={target} or grant CAP_SYS_NICE")
    return changed, None
