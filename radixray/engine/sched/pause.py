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

# The modes themselves are declared with the other control arguments: engine/control.py.
ABORT_MESSAGE = "aborted by pause_generation(mode='abort')"
