"""Per-worker circuit breaker: stop routing to a worker after consecutive failures.

States per worker:

- ``closed``: requests flow; failures are counted, a success resets the count.
- ``open``: ``failure_threshold`` consecutive failures were recorded; :meth:`allows` says
  False until ``cooldown_s`` has passed since it opened.
- ``half_open``: open and the cooldown has passed; :meth:`allows` says True again. The
  next outcome decides: a success closes the circuit, a failure reopens it at once with a
  fresh cooldown.

Not thread-safe: the owner (the router) serializes calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _WorkerCircuit:
    failures: int = 0
    opened_at: float | None = None


class CircuitBreaker:
    """Tracks consecutive failures per worker; workers never seen are closed."""

    def __init__(
        self,
        failure_threshold: int = 5,
        cooldown_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold!r}")
        if cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, got {cooldown_s!r}")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._circuits: dict[str, _WorkerCircuit] = {}

    def record_success(self, worker: str) -> None:
        """Close ``worker``'s circuit and reset its failure count."""
        self._circuits.pop(worker, None)

    def record_failure(self, worker: str) -> None:
        """Count a consecutive failure; open the circuit at the threshold.

        A failure while half-open reopens the circuit with a fresh cooldown. A failure
        while open (a request that started before it opened) only adds to the count.
        """
        circuit = self._circuits.setdefault(worker, _WorkerCircuit())
        circuit.failures += 1
        state = self.state(worker)
        if state == "half_open" or (
            state == "closed" and circuit.failures >= self.failure_threshold
        ):
            circuit.opened_at = self._clock()

    def allows(self, worker: str) -> bool:
        """True when closed or half-open; False while open within the cooldown."""
        return self.state(worker) != "open"

    def state(self, worker: str) -> str:
        """``"closed"``, ``"open"`` or ``"half_open"``."""
        circuit = self._circuits.get(worker)
        if circuit is None or circuit.opened_at is None:
            return "closed"
        if self._clock() - circuit.opened_at >= self.cooldown_s:
            return "half_open"
        return "open"

    def open_workers(self) -> list[str]:
        """Workers whose circuit is open and still cooling down (sorted)."""
        return sorted(w for w in self._circuits if self.state(w) == "open")

    def consecutive_failures(self, worker: str) -> int:
        """Failures since the last success (0 for a worker never seen)."""
        circuit = self._circuits.get(worker)
        return 0 if circuit is None else circuit.failures

    def forget(self, worker: str) -> None:
        """Drop everything known about ``worker`` (it becomes closed)."""
        self._circuits.pop(worker, None)
