"""How the scheduler survives a step that raises, and when it gives up.

A step that raises while building, running or processing a batch fails only that
batch's requests (finish reason ``error``, status 500) and the loop goes on.
:class:`StepFaults` counts such steps; after ``max_consecutive`` of them in a row
the engine is *failed*: every request it holds and every new one ends at once
with status 503, so callers retry elsewhere instead of waiting on an engine that
cannot serve. Only a new engine (a restarted worker) leaves that state.

:meth:`StepFaults.inject` is the test hook: the next ``count`` forward passes
raise :class:`InjectedFault`.
"""

from __future__ import annotations

from dataclasses import dataclass

BATCH_FAULT_STATUS = 500  # the request's batch failed; it may be the cause, so not retried
ENGINE_FAILED_STATUS = 503  # the engine stopped serving: retry on another engine


class EngineFailed(RuntimeError):
    """The engine stopped serving (its scheduler failed or died); retry on another engine."""


class InjectedFault(RuntimeError):
    """Raised by a forward pass that a test asked to fail (see :meth:`StepFaults.inject`)."""


@dataclass(frozen=True)
class EngineHealth:
    """What ``Engine.health()`` and a worker's ``ping()`` report about the scheduler."""

    alive: bool  # the scheduler thread runs
    failed: str | None  # why the engine stopped serving; None while it serves
    failed_steps: int  # steps whose batch failed since start
    consecutive_failed_steps: int

    @property
    def ok(self) -> bool:
        return self.alive and self.failed is None

    @property
    def reason(self) -> str:
        if not self.alive:
            return "the scheduler thread is not running"
        return self.failed or "ok"


@dataclass
class StepFaults:
    """Failed-step accounting of one scheduler (scheduler thread only, except ``inject``)."""

    max_consecutive: int
    consecutive: int = 0
    total: int = 0
    failed: str | None = None
    last_message: str | None = None
    _inject_left: int = 0  # forward passes left to fail; -1: every one
    _inject_message: str = "injected fault"

    def note_success(self) -> None:
        self.consecutive = 0

    def note_failure(self, message: str) -> str | None:
        """Count a failed step; the reason to fail the engine once the limit is reached."""
        self.consecutive += 1
        self.total += 1
        self.last_message = message
        if self.failed is None and self.consecutive >= self.max_consecutive:
            return f"{self.consecutive} scheduler steps failed in a row; the last: {message}"
        return None

    def inject(self, count: int, message: str = "injected fault") -> None:
        """Make the next ``count`` forward passes raise (-1: all of them; 0: stop)."""
        if count < -1:
            raise ValueError(f"count must be >= -1, got {count}")
        self._inject_left, self._inject_message = count, message

    def before_forward(self) -> None:
        """Raise :class:`InjectedFault` if a test asked this forward pass to fail."""
        if self._inject_left:
            if self._inject_left > 0:
                self._inject_left -= 1
            raise InjectedFault(self._inject_message)


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, for logs and the error a client sees."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
