"""Pausing generation for a weight update or a memory release (SGLang's three modes).

- ``abort``: every running, prefilling and waiting request ends with finish reason
  abort.
- ``retract``: running and prefilling requests go back to the waiting queue with their
  KV freed; after :func:`resume` they prefill again (prompt and output so far) and go
  on, so their output is what it would have been (up to the new weights).
- ``in_place``: requests keep their KV and their place and simply stop being
  scheduled.

While paused the scheduler runs no step; new requests wait in the queue, and control
calls are still answered between (absent) steps. Run these on the scheduler thread.
"""

from __future__ import annotations

from radixray.engine.control_types import PAUSE_MODES

ABORT_MESSAGE = "aborted by pause_generation(mode='abort')"


def pause(scheduler, mode: str) -> int:
    """Pause ``scheduler`` in ``mode``; return how many requests the mode touched
    (aborted, retracted, or held in place). Pausing again switches the mode."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
    chunked = [scheduler.chunked_req] if scheduler.chunked_req is not None else []
    touched = list(scheduler.running) + chunked
    if mode == "abort":
        touched = scheduler.waiting + touched
        for req in touched:
            scheduler.abort(req.rid, ABORT_MESSAGE)
    elif mode == "retract":
        for req in touched:
            if req is scheduler.chunked_req:
                scheduler.chunked_req = None
                scheduler.running.append(req)  # retract() takes it from the running list
            scheduler.retract(req)
    scheduler.paused = mode
    return len(touched)


def resume(scheduler) -> bool:
    """Schedule again; False if the scheduler was not paused. ValueError, changing nothing,
    while memory is released (engine/mem_cache/memory_saver.py): a step would run on freed tensors."""
    released = sorted(getattr(scheduler, "memory_released", ()))
    if released:
        raise ValueError(f"continue_generation: the memory of {released} is released; "
                         f"call resume_memory_occupation({released}) first")
    was = scheduler.paused is not None
    scheduler.paused = None
    return was
