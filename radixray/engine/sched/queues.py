"""The scheduler's requests by stage: waiting for admission, being prefilled in chunks, and
decoding.

:class:`RequestQueues` is the one place these collections change, through named
transitions. The scheduler holds the only instance; its own parts call the transitions
(the prefill builder admits, requeues and sets the chunked request), and everything
outside engine/sched/ reads the scheduler's counts or asks it to act (enqueue, retract,
finish, abort), never edits a list. Views are tuples,
so a caller that keeps one cannot change the queues by accident, and a caller that
iterates one may act on the requests while it does.
"""

from __future__ import annotations

from collections.abc import Callable

from radixray.engine.request import Req


class RequestQueues:
    """``waiting`` (admission order; the policy reorders a copy), ``chunked`` (the one
    request whose prompt is prefilled chunk by chunk; it is in neither list) and ``running``
    (decoding, in arrival order, or stably sorted by ``running_order`` when one is set: with
    LoRA, the adapter slot, so each adapter's rows of a decode batch are consecutive). A
    request is in at most one of them."""

    def __init__(self) -> None:
        self._waiting: list[Req] = []
        self._running: list[Req] = []
        self._chunked: Req | None = None
        self.max_running_seen = 0  # peak number of requests decoding together (tests, logs)
        self.running_order: Callable[[Req], int] | None = None

    # ---- reading -------------------------------------------------------------------
    @property
    def waiting(self) -> tuple[Req, ...]:
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[Req, ...]:
        return tuple(self._running)

    @property
    def chunked(self) -> Req | None:
        return self._chunked

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_prefill_work(self) -> bool:
        """A waiting request or a chunked prompt to continue."""
        return bool(self._waiting) or self._chunked is not None

    @property
    def empty(self) -> bool:
        return not (self._waiting or self._running or self._chunked)

    def active(self) -> list[Req]:
        """The requests holding KV slots: running, then the chunked one."""
        return self._running + ([self._chunked] if self._chunked is not None else [])

    def scheduled(self) -> list[Req]:
        """Every request of the three stages: waiting, running, chunked."""
        return self._waiting + self.active()

    def find(self, rid: str) -> Req | None:
        """The request ``rid`` in any stage, or None."""
        for req in self.scheduled():
            if req.rid == rid:
                return req
        return None

    # ---- transitions ---------------------------------------------------------------
    def enqueue(self, req: Req) -> None:
        """``req`` waits for admission, behind the others."""
        self._waiting.append(req)

    def requeue_front(self, req: Req) -> None:
        """``req`` (admitted, then refused its slots) waits again, ahead of the others."""
        self._remove(req)
        self._waiting.insert(0, req)

    def admit(self, req: Req) -> None:
        """``req`` leaves the waiting queue for this step's prefill batch."""
        self._waiting.remove(req)

    def set_chunked(self, req: Req | None) -> None:
        """The request whose prompt continues next prefill (None: none)."""
        self._chunked = req

    def start_running(self, req: Req) -> None:
        """``req`` decodes from the next step on."""
        self._running.append(req)
        if self.running_order is not None:
            self._running.sort(key=self.running_order)
        self.max_running_seen = max(self.max_running_seen, len(self._running))

    def drop_finished(self) -> None:
        """Running requests that finished leave the batch."""
        self._running = [r for r in self._running if not r.finished]
        self.max_running_seen = max(self.max_running_seen, len(self._running))

    def remove(self, req: Req) -> None:
        """Take ``req`` out of whichever stage holds it (its KV is not touched)."""
        self._remove(req)

    def _remove(self, req: Req) -> None:
        if req is self._chunked:
            self._chunked = None
        for group in (self._waiting, self._running):
            if req in group:
                group.remove(req)
