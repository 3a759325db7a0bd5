"""How other threads reach the scheduler: a thread-safe inbox drained between steps.

Items are a list of new requests, an :class:`AbortCommand`, a :class:`CallInLoop`, a
grammar wake or a message of a disaggregated side; the scheduler decides what each means.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass


@dataclass
class AbortCommand:
    rid: str


@dataclass
class CallInLoop:
    """Run ``fn(scheduler)`` on the scheduler thread between steps; the result goes to ``future``."""

    fn: Callable[[object], object]
    future: Future


class Inbox:
    """A FIFO any thread may put into; only the scheduler thread takes out."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, item) -> None:
        self._queue.put(item)

    def qsize(self) -> int:
        """Items not yet taken (an estimate while other threads put)."""
        return self._queue.qsize()

    def drain(self, handle: Callable[[object], None], block_s: float = 0.0) -> None:
        """Hand every waiting item to ``handle`` in order, waiting up to ``block_s`` for the
        first when none waits."""
        try:
            item = self._queue.get(timeout=block_s) if block_s > 0 else self._queue.get_nowait()
        except queue.Empty:
            return
        while True:
            handle(item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
