"""Turning a forward pass's logits into tokens: sampling under each request's grammar mask,
appending the token, checking stops, and saying what each request does next.

:class:`OutputProcessor` changes requests (their tokens, logprobs, finish) and the KV
cache's record of them, never the scheduler's queues: it returns a
:class:`ProcessedStep` and the scheduler moves requests accordingly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from radixray.engine.executor.sampler import SampleOutput, Sampler
from radixray.engine.faults import BATCH_FAULT_STATUS
from radixray.engine.grammar.matcher import apply_masks
from radixray.engine.mem_cache.kv_manager import KVManager
from radixray.engine.request import FinishReason, Req
from radixray.engine.sched.stats import SchedulerStats
from radixray.engine.stop import StopChecker

logger = logging.getLogger("radixray.scheduler")


@dataclass
class ProcessedStep:
    """What a step's sampled tokens did: ``reported`` (every request with new output or a
    finish, to deliver), ``started`` (prefills that go on decoding) and ``handed_off``
    (prefills of a disaggregated prefill side: the decode worker goes on)."""

    reported: list[Req] = field(default_factory=list)
    started: list[Req] = field(default_factory=list)
    handed_off: list[Req] = field(default_factory=list)


class OutputProcessor:
    """Sampling and token processing for one scheduler. ``finish(req, reason)`` ends a
    request (the scheduler's: it releases the KV and takes the request out of its queues)."""

    def __init__(self, sampler: Sampler, stop_checker: StopChecker, kv: KVManager,
                 stats: SchedulerStats, vocab_size: int, context_len: int,
                 finish: Callable[[Req, FinishReason], None]):
        self.sampler, self.stop_checker, self.kv, self.stats = sampler, stop_checker, kv, stats
        self.vocab_size, self.context_len = vocab_size, context_len
        self.finish = finish

    def sample_and_process(self, logits: torch.Tensor, reqs: list[Req], prefill: bool,
                           hand_off: bool = False) -> ProcessedStep:
        """Sample one token per row of ``logits`` (row ``i`` for ``reqs[i]``) and process it.
        A request with no tokens left to produce finishes at length without sampling.
        ``hand_off``: this engine is a prefill side, whose requests with a bootstrap room
        stop after their first token."""
        now = time.perf_counter()
        zero_budget = [r for r in reqs if r.remaining_new_tokens == 0]
        for r in zero_budget:
            self.finish(r, FinishReason("length", length=len(r.output_ids)))
        if zero_budget:
            keep = [i for i, r in enumerate(reqs) if not r.finished]
            logits, reqs = logits[keep], [reqs[i] for i in keep]
        result = ProcessedStep(reported=list(zero_budget))
        if reqs:
            apply_masks(logits, reqs, self.vocab_size)
            out = self.sampler.sample(logits, [r.sampling for r in reqs],
                                      [r.generator for r in reqs], [r.output_ids for r in reqs])
            self.process_sampled(out, reqs, prefill, now, result, hand_off)
        return result

    def process_sampled(self, out: SampleOutput, reqs: list[Req], prefill: bool, now: float,
                        result: ProcessedStep | None = None,
                        hand_off: bool = False) -> ProcessedStep:
        """Give each request its sampled token (``out``: the Sampler's output, row ``i`` for
        ``reqs[i]``), then finish it at a stop, or (prefill) mark it started or handed off.
        Every request of ``reqs`` is reported."""
        result = result if result is not None else ProcessedStep()
        result.reported.extend(reqs)
        errors = out.errors or {}
        for i, (req, token) in enumerate(zip(reqs, out.token_ids)):
            if i in errors:
                logger.warning("request %s failed: %s", req.rid, errors[i])
                self.finish(req, FinishReason("error", message=errors[i],
                                              status=BATCH_FAULT_STATUS))
                continue
            req.output_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = now
            if out.logprobs is not None and req.sampling.return_logprob:
                req.output_logprobs.append(out.logprobs[i])
                if out.top_logprobs is not None:
                    req.output_top_logprobs.append(out.top_logprobs[i])
            if prefill and hand_off and req.pd is not None:
                # Prefill half of a pair: the decode worker checks stops and decodes.
                self.kv.cache_unfinished(req)
                result.handed_off.append(req)
                continue
            reason = req.grammar.accept(token) if req.grammar is not None else None
            reason = reason or self.stop_checker.check(req, self.context_len)
            if reason is not None:
                self.finish(req, reason)
            elif prefill:
                # Share the prompt's KV through the tree now, not when the request
                # ends, so requests arriving meanwhile with the same prefix hit it.
                self.kv.cache_unfinished(req)
                result.started.append(req)
        self.stats.generation_tokens += len(reqs) - len(errors)
        return result
