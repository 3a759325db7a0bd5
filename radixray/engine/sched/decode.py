"""Decode strategies: how a scheduler step decodes its running batch.

- :class:`PlainDecoder`: one token per running request per forward pass; when the pool
  cannot hold the next step, requests are retracted first (sent back to the waiting
  queue with their KV freed), and the last one left is aborted if even it cannot grow.
- :class:`SpeculativeDecoder` (``speculative_algorithm``): a verify step over each
  request's draft when any has one (engine/speculative/), else a plain step.
- :class:`~radixray.engine.sched.overlap.OverlapDecoder` (``enable_overlap_schedule``):
  plain steps pipelined with the scheduler's own work.

A decoder reads the scheduler's queues and asks the scheduler to move requests (retract,
finish, report); it never edits them. The scheduler picks one from its config.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from radixray.engine.request import FinishReason, Req
from radixray.engine.sched.admission import RETRACT_DECODE_STEPS, retraction_order
from radixray.engine.sched.step import StepHost, StepRecord

if TYPE_CHECKING:
    from radixray.engine.speculative.worker import NgramSpeculator

logger = logging.getLogger("radixray.scheduler")

OOM_ABORT_MESSAGE = ("Out of memory even after retracting all other requests: the KV pool cannot "
                     "hold this request's next token; raise max_total_tokens or lower max_new_tokens")


class PlainDecoder:
    """One decode token per running request per step (see the module docstring)."""

    def __init__(self, scheduler: StepHost):
        self.s = scheduler

    # ---- what a pipelined decoder overrides ------------------------------------------
    @property
    def busy(self) -> bool:
        """Work of an earlier step is still in flight (never, for a sequential decoder)."""
        return False

    def holds(self, req: Req) -> bool:
        """Whether a step in flight still writes ``req``'s KV."""
        return False

    def defer_release(self, req: Req) -> None:
        raise AssertionError("a sequential decoder holds no request past its step")

    def holders(self) -> list[Req]:
        """Finished requests whose KV the decoder still holds."""
        return []

    def drain(self) -> None:
        """Finish any step in flight before the scheduler does something else."""

    def close(self) -> None:
        """The loop has ended."""

    # ---- the step --------------------------------------------------------------------
    def decode(self, step: StepRecord) -> None:
        """Decode every running request one token (after retracting for room)."""
        if not self.make_room():
            return
        reqs = list(self.s.queues.running)
        step.add(reqs)
        self.forward(reqs, step)

    def make_room(self) -> bool:
        """Retract running requests until the pool holds the next step; False when no
        request is left to decode. A step with room counts for the new-token forecast."""
        s = self.s
        if s.kv.available_tokens() < s.queues.num_running:
            self._retract_for_decode()
            return s.queues.num_running > 0
        s.ratio.step()
        return True

    def forward(self, reqs: list[Req], step: StepRecord) -> None:
        """One plain decode forward over ``reqs`` (the running batch) and its tokens."""
        s = self.s
        slots = s.kv.extend_decode(reqs)
        batch = s.runner.build_decode_batch(reqs, slots)
        s.faults.before_forward()
        logits = s.runner.forward(batch)
        step.forwarded = True
        s.stats.forward_steps += 1
        s.stats.note_decode(len(reqs))
        for r in reqs:
            r.commit_kv(1)
        s.process_logits(logits, reqs, prefill=False)
        s.log_decode_interval()

    def _retract_for_decode(self) -> None:
        """Free KV for the next decode step by sending requests back to the waiting queue
        (admission.py orders them); abort the last one if even alone it cannot grow."""
        s = self.s
        order = retraction_order(list(s.queues.running))
        retracted: list[Req] = []
        while order and (not retracted or
                         s.kv.available_tokens() < RETRACT_DECODE_STEPS * len(order)):
            if len(order) == 1:
                break
            victim = order.pop(0)
            s.retract(victim)
            retracted.append(victim)
        if order and s.kv.available_tokens() < len(order):
            s.end_request(order[0], FinishReason("abort", message=OOM_ABORT_MESSAGE))
        old = s.ratio.value
        s.ratio.reset_after_retraction(list(s.queues.running))
        logger.warning("KV cache pool is full. Retract requests. #retracted_reqs: %d, "
                       "#new_token_ratio: %.4f -> %.4f", len(retracted), old, s.ratio.value)


class SpeculativeDecoder(PlainDecoder):
    """A verify step over the drafts when any running request has one, else a plain step."""

    def __init__(self, scheduler: StepHost, speculator: NgramSpeculator):
        super().__init__(scheduler)
        self.speculator = speculator

    def decode(self, step: StepRecord) -> None:
        if not self.make_room():
            return
        reqs = list(self.s.queues.running)
        step.add(reqs)
        if not self.speculator.decode_step(self.s, reqs, step):
            self.forward(reqs, step)

