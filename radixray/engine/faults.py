"""How the scheduler survives a step that raises, and when it gives up.

A step that raises while building, running or processing a batch fails only that
batch's requests (finish reason ``error``, status 500) and the loop goes on.
:class:`StepFaults` counts such steps; after ``max_consecutive`` of them in a row
the engine is *failed*: every request it holds and every new one ends at once
with status 503, so callers retry elsewhere instead of waiting on an engine that
cannot serve. Only a new engine (a restarted worker) leaves that state.

Tests make things fail through one object, :class:`FaultInjector`, armed with typed fault
specs (:class:`FailForwards`, :class:`StallKVSend`, :class:`FailWeightUpdate`,
:class:`FailTrainerSend`) and attached by test code only
(``Engine.attach_fault_injector``, the same method on the worker and trainer actors).
Production code asks it at its fault points; with none attached that costs one ``None``
check.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

BATCH_FAULT_STATUS = 500  # the request's batch failed; it may be the cause, so not retried
ENGINE_FAILED_STATUS = 503  # the engine stopped serving: retry on another engine


class EngineFailed(RuntimeError):
    """The engine stopped serving (its scheduler failed or died); retry on another engine."""


class InjectedFault(RuntimeError):
    """Raised by a forward pass that a test asked to fail (see :class:`FailForwards`)."""


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
    """Failed-step accounting of one scheduler (scheduler thread only)."""

    max_consecutive: int
    consecutive: int = 0
    total: int = 0
    failed: str | None = None
    last_message: str | None = None
    injector: FaultInjector | None = None  # tests only (Engine.attach_fault_injector)

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

    def before_forward(self) -> None:
        """Raise :class:`InjectedFault` if a test asked this forward pass to fail."""
        if self.injector is not None:
            self.injector.before_forward()


# ---- fault specs (what a test asks for) --------------------------------------------------
@dataclass(frozen=True)
class FailForwards:
    """The next ``count`` forward passes raise :class:`InjectedFault` (-1: every one; 0: none)."""

    count: int
    message: str = "injected fault"

    def __post_init__(self):
        if self.count < -1:
            raise ValueError(f"count must be >= -1, got {self.count}")


@dataclass(frozen=True)
class SlowForwards:
    """Every forward pass first sleeps ``seconds`` (0: off), as a slow model would: requests
    stay in flight long enough for what a test does to them meanwhile."""

    seconds: float

    def __post_init__(self):
        if self.seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {self.seconds}")


@dataclass(frozen=True)
class StallKVSend:
    """A prefill engine's KV sender sleeps ``seconds`` before the next room's last write (its
    first chunks are written), as a transfer cut mid-way."""

    seconds: float


WEIGHT_UPDATE_PHASES = ("prepare", "commit")
TRAINER_SEND_PHASES = ("write_shared", "broadcast")


@dataclass(frozen=True)
class FailWeightUpdate:
    """The engine's next ``prepare`` or ``commit`` of a weight update raises (None: off)."""

    phase: str | None

    def __post_init__(self):
        if self.phase not in (None, *WEIGHT_UPDATE_PHASES):
            raise ValueError(f"phase must be one of {WEIGHT_UPDATE_PHASES} or None, "
                             f"got {self.phase!r}")


@dataclass(frozen=True)
class FailTrainerSend:
    """The trainer's next ``write_shared`` or ``broadcast`` fails after sending half the
    tensors, as a trainer dying mid-update would (None: off)."""

    phase: str | None

    def __post_init__(self):
        if self.phase not in (None, *TRAINER_SEND_PHASES):
            raise ValueError(f"phase must be 'write_shared', 'broadcast' or None, "
                             f"got {self.phase!r}")


Fault = FailForwards | SlowForwards | StallKVSend | FailWeightUpdate | FailTrainerSend


class FaultInjector:
    """The faults a test asked for, consulted by production code at its fault points.

    Build it with the specs (``FaultInjector(FailForwards(1))``) or :meth:`arm` it later;
    arming a kind again replaces that kind's spec. Each fault point reads and clears its own
    fields only, so the scheduler, the KV sender and a caller's thread may consult it at
    once while a test arms it. It holds plain data: it crosses to an actor by value.
    """

    def __init__(self, *faults: Fault):
        self._forwards_left = 0  # forward passes left to fail; -1: every one
        self._forward_message = "injected fault"
        self._forward_delay_s = 0.0
        self._kv_stall_s: float | None = None
        self.kv_stalled = False  # True while a stall holds the KV sender
        self._weight_phase: str | None = None
        self._trainer_phase: str | None = None
        for fault in faults:
            self.arm(fault)

    def arm(self, fault: Fault) -> None:
        if isinstance(fault, FailForwards):
            self._forwards_left, self._forward_message = fault.count, fault.message
        elif isinstance(fault, SlowForwards):
            self._forward_delay_s = fault.seconds
        elif isinstance(fault, StallKVSend):
            self._kv_stall_s = fault.seconds
        elif isinstance(fault, FailWeightUpdate):
            self._weight_phase = fault.phase
        elif isinstance(fault, FailTrainerSend):
            self._trainer_phase = fault.phase
        else:
            raise TypeError(f"not a fault spec: {fault!r}")

    # ---- fault points ------------------------------------------------------------------
    def before_forward(self) -> None:
        """Scheduler thread, before a forward pass: sleep if slowed, raise
        :class:`InjectedFault` if armed."""
        if self._forward_delay_s:
            time.sleep(self._forward_delay_s)
        if self._forwards_left:
            if self._forwards_left > 0:
                self._forwards_left -= 1
            raise InjectedFault(self._forward_message)

    def before_kv_write(self, final: bool) -> None:
        """KV sender thread, before a write (``final``: a room's last): sleep if a stall is
        armed for this write."""
        seconds = self._kv_stall_s
        if final and seconds is not None:
            self._kv_stall_s = None
            self.kv_stalled = True
            time.sleep(seconds)
            self.kv_stalled = False

    def before_weight_update(self, phase: str, where: str) -> None:
        """Before ``phase`` (prepare | commit) of a weight update on ``where``: raise if armed."""
        if self._weight_phase == phase:
            self._weight_phase = None
            raise RuntimeError(f"injected weight update fault at {phase} on {where}")

    def trainer_items(self, phase: str, items: list) -> Iterable:
        """What the trainer sends in ``phase``: ``items``, or (armed) their first half and
        then a RuntimeError."""
        if self._trainer_phase != phase:
            return items
        self._trainer_phase = None

        def failing() -> Iterator:
            yield from items[:len(items) // 2]
            raise RuntimeError(f"injected trainer fault during {phase}")
        return failing()


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, for logs and the error a client sees."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def raise_if_engine_failed(req, faults: StepFaults) -> None:
    """``req`` ended because the whole engine failed: raise that as :class:`EngineFailed`
    (a batch fault or a failed disaggregated transfer is not raised; it is the request's
    own result, finish reason ``error``)."""
    reason = req.finish_reason
    if reason is not None and reason.type == "error" and reason.status == ENGINE_FAILED_STATUS \
            and faults.failed is not None:
        raise EngineFailed(reason.message)
