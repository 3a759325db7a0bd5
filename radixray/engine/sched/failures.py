"""Failing a batch, or the whole engine, and ending the requests it touched.

A fault inside a step fails that step's requests (status 500); repeated faults, or one
outside any batch, fail the engine (status 503 for every held and later request) until
the controller replaces it. :class:`StepFailures` decides and ends the requests; the
scheduler passes in how to take a request out of its queues, how to end one, how to
deliver results and which requests it holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from radixray.engine.faults import BATCH_FAULT_STATUS, ENGINE_FAILED_STATUS, StepFaults, describe
from radixray.engine.request import FinishReason, Req

logger = logging.getLogger("radixray.scheduler")


class StepFailures:
    """The scheduler's fault handling. ``unschedule(req)`` takes a request out of the queues,
    ``finish(req, reason)`` ends it (its KV back), ``deliver(reqs)`` hands results on,
    ``held()`` lists every unfinished request the scheduler holds, ``on_engine_failed(reason)``
    runs once when the engine fails, before any request learns of it: a caller that sees
    its request fail with the engine can count on the listeners having heard."""

    def __init__(self, faults: StepFaults, unschedule: Callable[[Req], None],
                 finish: Callable[[Req, FinishReason], None],
                 deliver: Callable[[list[Req]], None], held: Callable[[], list[Req]],
                 on_engine_failed: Callable[[str], None]):
        self.faults = faults
        self._unschedule, self._finish, self._deliver = unschedule, finish, deliver
        self._held, self._on_engine_failed = held, on_engine_failed

    def step_fault(self, exc: Exception, reqs: list[Req]) -> None:
        """A step failed with ``exc``: fail its requests ``reqs`` (status 500); log the
        traceback once per distinct fault; count it, and after too many in a row fail the
        engine too."""
        message = describe(exc)
        if message == self.faults.last_message:
            logger.error("scheduler step failed again (%d in a row): %s",
                         self.faults.consecutive + 1, message)
        else:
            logger.exception("scheduler step failed; its batch's requests end with an error")
        give_up = self.faults.note_failure(message)
        if give_up:
            self._mark_failed(give_up)
        self.fail(reqs, f"the engine failed this request's batch: {message}", BATCH_FAULT_STATUS)
        if give_up:
            self.fail_engine(give_up)

    def fail_engine(self, reason: str) -> None:
        """Stop serving: every held request and every later one ends with status 503. Later
        calls keep the first reason."""
        self._mark_failed(reason)
        self.fail(self._held(), f"the engine failed: {self.faults.failed}",
                  ENGINE_FAILED_STATUS)

    def _mark_failed(self, reason: str) -> None:
        """The engine is failed from now on (the first reason stays); tell the hook once."""
        if self.faults.failed is None:
            self.faults.failed = reason
            logger.error("engine failed, refusing requests from now on: %s", reason)
            self._on_engine_failed(reason)

    def fail(self, reqs: list[Req], message: str, status: int) -> None:
        """End every unfinished request of ``reqs`` with finish reason error and deliver all
        of them (a request that finished normally in the failed step still gets its result).
        Each request's KV goes back even when others' cannot."""
        reqs = list(dict.fromkeys(reqs))
        for req in reqs:
            if req.finished:
                continue
            self._unschedule(req)
            reason = FinishReason("error", message=message, status=status)
            try:
                self._finish(req, reason)
            except Exception:  # noqa: BLE001 - its KV is lost, but the request still ends
                logger.exception("could not return the KV of failed request %s", req.rid)
                req.finish_reason = reason
        try:
            self._deliver(reqs)
        except Exception:  # noqa: BLE001 - a broken subscriber must not stop the loop
            logger.exception("could not deliver the results of %d failed request(s)", len(reqs))
