"""The engine's compute thread: it builds the model runner, then runs the scheduler loop.

torch's CPU wheels and radixray's C++ kernels run their parallel regions on libgomp,
which keeps a team of worker threads for every thread that ever ran one. Once a process
holds more of those threads than it has CPUs, libgomp stops spinning between regions and
each region wakes its workers through the kernel instead: tens of microseconds per op,
paid by every projection of every step. An engine that loaded its model on the calling
thread and stepped on its scheduler thread had two teams; on a 2-CPU host that made a
batch-1 int8 projection about 86 us instead of 14 us, and a batch-1 decode step 14.3 ms
instead of 9.8 ms (docs/benchmarks.md). So the model is built, compiled and run on one
thread, and the thread that constructs the engine runs no parallel region for it. (Other
threads of the process should not either: common/passing_thread.py.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


def start_compute_thread(build: Callable[[], None], run: Callable[[], None], name: str,
                         num_threads: int) -> threading.Thread:
    """Start a daemon thread that sets torch's intra-op thread count to ``num_threads``
    (OpenMP's count is per thread: pass the constructing thread's), calls ``build()`` and
    then ``run()``. Returns the thread once ``build`` has returned; an exception ``build``
    raised is raised here instead (and the thread ends without calling ``run``)."""
    built = threading.Event()
    failure: list[BaseException] = []

    def main() -> None:
        torch.set_num_threads(num_threads)
        try:
            build()
        except BaseException as exc:  # noqa: BLE001 - handed to the constructing thread
            failure.append(exc)
            return
        finally:
            built.set()
        run()

    thread = threading.Thread(target=main, name=name, daemon=True)
    thread.start()
    built.wait()
    if failure:
        raise failure[0]
    return thread
