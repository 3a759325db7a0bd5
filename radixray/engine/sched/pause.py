"""Pausing generation for a weight update or a memory release (SGLang's three modes), as
:meth:`Scheduler.pause <radixray.engine.sched.scheduler.Scheduler.pause>` does it.

- ``abort``: every running, prefilling and waiting request ends with finish reason
  abort.
- ``retract``: running and prefilling requests go back to the waiting queue with their
  KV freed; after ``Scheduler.resume`` they prefill again (prompt and output so far) and
  go on, so their output is what it would have been (up to the new weights).
- ``in_place``: requests keep their KV and their place and simply stop being
  scheduled.

While paused the scheduler runs no step; new requests wait in the queue, and control
calls are still answered between (absent) steps. Both run on the scheduler thread.
"""

from __future__ import annotations

from radixray.engine.control import PAUSE_MODES

# The modes themselves are declared with the other control arguments: engine/control.py.
ABORT_MESSAGE = "aborted by pause_generation(mode='abort')"


def pause_in_mode(scheduler, mode: str) -> int:
    """Pause ``scheduler`` in ``mode``; return how many requests the mode touched (aborted,
    retracted, or held in place). Pausing again switches the mode. ValueError naming the
    modes for any other ``mode``."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
    touched = scheduler.queues.active()
    if mode == "abort":
        touched = list(scheduler.queues.waiting) + touched
        for req in touched:
            scheduler.abort(req.rid, ABORT_MESSAGE)
    elif mode == "retract":
        for req in touched:
            scheduler.retract(req)
    scheduler.paused = mode
    return len(touched)


def resume_scheduling(scheduler) -> bool:
    """Schedule again; False if not paused. ValueError, changing nothing, while memory is
    released (engine/mem_cache/memory_saver.py): a step would run on freed tensors."""
    released = sorted(scheduler.memory_released)
    if released:
        raise ValueError(f"continue_generation: the memory of {released} is released; "
                         f"call resume_memory_occupation({released}) first")
    was = scheduler.paused is not None
    scheduler.paused = None
    return was
