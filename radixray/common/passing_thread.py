"""Parallel torch work beside an engine, on a thread that ends with it.

An engine steps on one thread (engine/compute_thread.py) because libgomp, the OpenMP
runtime of torch's CPU wheels and of radixray's kernels, keeps a team of worker threads for
every thread that ran a parallel region, and stops spinning between regions once a
process holds more of them than it has CPUs. Any other long-lived thread of the process
that runs a parallel torch op (a benchmark measuring memory bandwidth on the main thread,
say) then slows every op of every engine step. A team ends with its thread:
:func:`in_passing_thread` runs such work on a thread of its own and joins it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


def in_passing_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on a new thread with the caller's torch thread count; its
    result, or the exception it raised. The thread (and its OpenMP team) ends before this
    returns."""
    threads = torch.get_num_threads()

    def call() -> T:
        torch.set_num_threads(threads)
        return fn(*args, **kwargs)
    with ThreadPoolExecutor(1, thread_name_prefix="radixray-passing") as pool:
        return pool.submit(call).result()
