"""Taking KV back from running requests, on the scheduler thread: retraction when the pool
cannot hold the next decode step, and priority preemption when a waiting request outranks
running ones. Both send their victims back to the waiting queue (``Scheduler.retract``);
see admission.py for the order and the budgets."""

from __future__ import annotations

import logging

from radixray.engine.request import FinishReason, Req
from radixray.engine.sched.admission import (
    RETRACT_DECODE_STEPS,
    PrefillBudget,
    new_request_need,
    retraction_order,
)

logger = logging.getLogger("radixray.scheduler")

OOM_ABORT_MESSAGE = ("Out of memory even after retracting all other requests: the KV pool cannot "
                     "hold this request's next token; raise max_total_tokens or lower max_new_tokens")


def retract_for_decode(s) -> None:
    """Free KV for the next decode step by sending requests back to the waiting queue."""
    order = retraction_order(s.running)
    retracted: list[Req] = []
    while order and (not retracted or
                     s.kv.available_tokens() < RETRACT_DECODE_STEPS * len(order)):
        if len(order) == 1:
            break
        victim = order.pop(0)
        s.retract(victim)
        retracted.append(victim)
    if order and s.kv.available_tokens() < len(order):
        # Even alone the last request cannot grow: abort instead of retrying forever.
        s.finish(order[0], FinishReason("abort", message=OOM_ABORT_MESSAGE))
        s.on_output([order[0]])
    old = s.ratio.value
    s.ratio.reset_after_retraction(s.running)
    logger.warning("KV cache pool is full. Retract requests. #retracted_reqs: %d, "
                   "#new_token_ratio: %.4f -> %.4f", len(retracted), old, s.ratio.value)


def preempt_for(s, req: Req, budget: PrefillBudget, extend_len: int | None = None) -> bool:
    """Priority scheduling: retract lower-priority running requests so ``req`` can start."""
    if not s.config.enable_priority_scheduling:
        return False
    threshold = s.config.priority_preemption_threshold
    victims = sorted((r for r in s.running if r.priority + threshold < req.priority),
                     key=lambda r: (r.priority, -r.arrival_time))
    need_rows = len(s.running) + len(budget.added) >= s.max_running
    freed_any = False
    for victim in victims:
        if not need_rows and (extend_len is None or
                              budget.rem_total_tokens >= new_request_need(extend_len, req)):
            break
        before = s.kv.available_tokens()
        s.retract(victim)
        budget.rem_total_tokens += s.kv.available_tokens() - before
        budget.rem_total_tokens += new_request_need(0, victim) * (
            1.0 if victim.sampling.ignore_eos else s.ratio.value)
        need_rows = False
        freed_any = True
    return freed_any
