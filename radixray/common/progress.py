"""Progress of long first-start work (a GGUF conversion, the kernel compile) that a user
would otherwise watch as a silent minute.

:class:`Stages` logs one line per finished stage with its number and the time since
the work began. :func:`counted` walks an iterable with a tqdm bar on a terminal, and
with a log line per quarter elsewhere (a Ray actor's output reaches the driver as
lines: a redrawn bar would arrive as noise). :class:`Ticker` logs a line every
``interval_s`` while a step that reports nothing itself (a compiler) runs.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


class Stages:
    """``done(what)`` logs ``"<title> [i/n] <what> (<elapsed> s)"``."""

    def __init__(self, logger: logging.Logger, title: str, total: int):
        self.logger, self.title, self.total = logger, title, total
        self.count = 0
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def done(self, what: str) -> None:
        self.count += 1
        self.logger.info("%s [%d/%d] %s (%.1f s)", self.title, self.count, self.total, what,
                         self.elapsed())


def counted(items: Iterable[T], total: int, desc: str, logger: logging.Logger,
            unit: str = "it") -> Iterator[T]:
    """Yield ``items``, showing how many of ``total`` are done."""
    if sys.stderr.isatty():
        from tqdm import tqdm
        yield from tqdm(items, total=total, desc=desc, unit=unit)
        return
    start = time.perf_counter()
    marks = {max(1, total * q // 4) for q in (1, 2, 3, 4)}
    for i, item in enumerate(items, 1):
        yield item
        if i in marks:
            logger.info("%s: %d/%d %s (%.1f s)", desc, i, total, unit, time.perf_counter() - start)


class Ticker:
    """A daemon thread logging ``message()`` every ``interval_s`` until the block ends."""

    def __init__(self, message: Callable[[float], str], logger: logging.Logger,
                 interval_s: float = 10.0):
        self.message, self.logger, self.interval_s = message, logger, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Ticker:
        start = time.perf_counter()

        def tick() -> None:
            while not self._stop.wait(self.interval_s):
                self.logger.info("%s", self.message(time.perf_counter() - start))
        self._thread = threading.Thread(target=tick, name="progress-ticker", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
