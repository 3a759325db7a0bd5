"""How the scheduler fails a batch, or itself, and ends the affected requests.

A mixin of :class:`~radixray.engine.sched.scheduler.Scheduler` (it reads ``faults``,
``_batch``, ``waiting``, ``running``, ``chunked_req``, ``on_output``, ``on_failed`` and
calls ``finish`` and ``held_requests``). A fault inside a step fails that step's batch
(status 500); repeated faults, or one outside any batch, fail the engine (status 503 for
every held and later request) until the controller replaces it.
"""

from __future__ import annotations

import logging

from radixray.engine.faults import BATCH_FAULT_STATUS, ENGINE_FAILED_STATUS, describe
from radixray.engine.request import FinishReason, Req

logger = logging.getLogger("radixray.scheduler")


class SchedulerFaults:
    def _on_step_fault(self, exc: Exception) -> None:
        """Fail the step's batch; log the traceback once per distinct fault; count it."""
        message = describe(exc)
        if message == self.faults.last_message:
            logger.error("scheduler step failed again (%d in a row): %s",
                         self.faults.consecutive + 1, message)
        else:
            logger.exception("scheduler step failed; its batch's requests end with an error")
        give_up = self.faults.note_failure(message)
        self._fail(self._batch, f"the engine failed this request's batch: {message}",
                   BATCH_FAULT_STATUS)
        if give_up:
            self.fail_engine(give_up)

    def fail_engine(self, reason: str) -> None:
        """Stop serving: every held request and every later one ends with status 503, and
        ``on_failed`` hears the reason once. Later calls keep the first reason."""
        first = self.faults.failed is None
        if first:
            self.faults.failed = reason
            logger.error("engine failed, refusing requests from now on: %s", reason)
            if getattr(self.runner, "eplb", None) is not None:
                self.runner.eplb.cancel(f"the engine failed: {reason}")
        held = self.held_requests()
        self._fail(held, f"the engine failed: {self.faults.failed}", ENGINE_FAILED_STATUS)
        if first and self.on_failed is not None:
            self.on_failed(reason)

    def _fail(self, reqs: list[Req], message: str, status: int) -> None:
        """End every unfinished request of ``reqs`` with finish reason error and deliver all
        of them (a request that finished normally in the failed step still gets its result).
        Each request's KV goes back even when others' cannot."""
        reqs = list(dict.fromkeys(reqs))
        for req in reqs:
            if req.finished:
                continue
            if req is self.chunked_req:
                self.chunked_req = None
            if req in self.waiting:
                self.waiting.remove(req)
            reason = FinishReason("error", message=message, status=status)
            try:
                self.finish(req, reason)
            except Exception:  # noqa: BLE001 - its KV is lost, but the request still ends
                logger.exception("could not return the KV of failed request %s", req.rid)
                req.finish_reason = reason
                if req in self.running:
                    self.running.remove(req)
        try:
            self.on_output(reqs)
        except Exception:  # noqa: BLE001 - a broken subscriber must not stop the loop
            logger.exception("could not deliver the results of %d failed request(s)", len(reqs))
