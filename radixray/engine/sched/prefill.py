"""A prefill step: which waiting requests start (or which chunk continues), their KV slots,
the forward pass, and what the tokens do.

:class:`PrefillBuilder` admits in the policy's order while the token budget
(admission.py) holds, reusing each request's prefix match; with priority scheduling a
request that outranks running ones by ``priority_preemption_threshold`` may retract them
(preemption) to get a row or tokens. A prompt longer than what is left of the chunk
budget is admitted as its first chunk and continues next step (the scheduler's chunked
slot). Mixed chunks (mixed_batch.py) add the running requests at the batch's tail; with
them, a step's chunk is sized by the inter-token-latency budget (chunk_budget.py).
"""

from __future__ import annotations

import logging
import time

import torch

from radixray.engine.mem_cache.radix_cache import MatchResult
from radixray.engine.request import Req
from radixray.engine.sched.admission import AddResult, PrefillBudget, new_request_need
from radixray.engine.sched.chunk_budget import ChunkBudget, ForwardCostModel, attention_pairs
from radixray.engine.sched.lora import AdapterAdmission, active_adapters
from radixray.engine.sched.mixed_batch import MixedChunks
from radixray.engine.sched.policy import InBatchPrefixes, order_waiting
from radixray.engine.sched.stats import log_prefill
from radixray.engine.sched.step import StepHost, StepRecord

logger = logging.getLogger("radixray.scheduler")

PrefillItems = list[tuple[Req, int, torch.Tensor]]  # (request, new tokens, their slots)


class PrefillBuilder:
    """Builds and runs the prefill steps of ``scheduler`` (its queues, KV manager and
    budget options); queue changes go through the scheduler's :class:`RequestQueues`.
    ``cost``: the step-time model to keep measuring (a reconfigured scheduler's)."""

    def __init__(self, scheduler: StepHost, cost: ForwardCostModel | None = None):
        self.s = scheduler
        s = scheduler
        self.config = s.config
        self.mixed = MixedChunks(s.config.enable_mixed_chunk, s.kv, s.runner, s.ratio, s.stats)
        self.chunks = ChunkBudget(s.config.itl_budget_ms, s.config.chunk_size, cost)

    # ---- building ---------------------------------------------------------------------
    def build(self, step: StepRecord) -> PrefillItems:
        """Admit waiting requests (and continue a chunked one); each admitted request joins
        ``step``. Empty when nothing can start."""
        s, queues = self.s, self.s.queues
        if not queues.has_prefill_work:
            return []
        kv = s.kv
        waiting = list(queues.waiting)
        kv.prepare_admission(waiting)
        running, chunked = list(queues.running), queues.chunked
        riders = self.mixed.num_riders(len(running))
        rider_pairs = sum(attention_pairs(r.kv_len, 1) for r in running) \
            if riders and self.chunks.timed else 0
        chunk = self.chunks.step_tokens(riders, rider_pairs,
                                        chunked.kv_len if chunked is not None else 0).tokens
        budget = PrefillBudget.start(kv.available_tokens(), running, s.ratio.value,
                                     self.config.max_prefill_tokens, chunk)
        budget.reserve_riders(riders, from_chunk=not self.chunks.timed)
        in_batch = InBatchPrefixes(enabled=not kv.cache.disabled)
        lora = getattr(s.runner, "lora", None)
        adapters = AdapterAdmission(lora.num_slots if lora is not None else None,
                                    active_adapters(queues))
        if chunked is not None:
            budget.add_chunk_continuation(chunked, chunked.seq_len - chunked.kv_len)
            in_batch.add(chunked)
            step.add([chunked])
        if budget.rem_chunk_tokens is not None and budget.rem_chunk_tokens <= 0:
            return self._allocate(budget.added, step)
        # lpm matches every waiting request to order them; reuse those matches below so a
        # request is matched (and its nodes' hit counts bumped) once per turn. A preemption
        # inserts into the tree, so matches taken before it are dropped.
        matches: dict[int, MatchResult] = {}

        def prefix_len(r: Req) -> int:
            matches[id(r)] = kv.match(r)
            return len(matches[id(r)].slots)

        ordered = order_waiting(waiting, self.config.schedule_policy,
                                cache_disabled=kv.cache.disabled, prefix_len=prefix_len,
                                priority_first=self.config.enable_priority_scheduling)
        for req in ordered:
            match = matches.get(id(req)) or kv.match(req)
            if in_batch.should_defer(req, len(match.slots)) or not adapters.admits(req):
                continue
            if queues.num_running + len(budget.added) >= s.max_running:
                if not self._preempt_for(req, budget):
                    break
                matches.clear()
                match = kv.match(req)
            matches.pop(id(req), None)
            extend_len = req.seq_len - len(match.slots)
            # Locking the matched prefix takes its evictable tokens out of the budget's
            # available count, so they cannot also pay for this request's new tokens.
            budget.rem_total_tokens -= kv.lock_cost(match)
            result = budget.try_add(req, extend_len)
            if result == AddResult.NO_TOKEN and self._preempt_for(req, budget, extend_len):
                matches.clear()
                result = budget.try_add(req, extend_len)
            if result == AddResult.NO_TOKEN and not queues.num_running and not budget.added \
                    and extend_len < kv.available_tokens():
                # Nothing else runs, so the forecast can never improve: start it and let
                # retraction or the out-of-memory abort handle growth past the pool.
                result = budget.try_add(req, extend_len, force=True)
            if result in (AddResult.NO_TOKEN, AddResult.OTHER):
                break
            if not kv.admit(req, match):
                budget.added.pop()
                break
            if req.num_retractions == 0:
                req.cached_tokens = len(match.slots)
            if req.admit_time is None:
                req.admit_time = time.perf_counter()
            queues.admit(req)
            step.add([req])
            in_batch.add(req)
            adapters.add(req)
            if result == AddResult.CHUNKED:
                break
        return self._allocate(budget.added, step)

    def _allocate(self, added: list[tuple[Req, int]], step: StepRecord) -> PrefillItems:
        """Reserve KV slots for each admitted chunk; requests that find none go back to the
        head of the waiting queue."""
        s = self.s
        items = []
        for req, n in added:
            slots = s.kv.extend(req, n)
            if slots is None:
                logger.warning("KV allocation of %d tokens failed for %s; requeued", n, req.rid)
                s.kv.release(req)
                s.queues.requeue_front(req)
                step.discard(req)
                continue
            items.append((req, n, slots))
        return items

    def _preempt_for(self, req: Req, budget: PrefillBudget, extend_len: int | None = None) -> bool:
        """Priority scheduling: retract lower-priority running requests so ``req`` can start
        (a row when the batch is full; with ``extend_len``, tokens for its prompt)."""
        if not self.config.enable_priority_scheduling:
            return False
        s = self.s
        threshold = self.config.priority_preemption_threshold
        victims = sorted((r for r in s.queues.running if r.priority + threshold < req.priority),
                         key=lambda r: (r.priority, -r.arrival_time))
        need_rows = s.queues.num_running + len(budget.added) >= s.max_running
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

    # ---- running ----------------------------------------------------------------------
    def run(self, items: PrefillItems, step: StepRecord) -> None:
        """The forward pass of a built batch (riders at its tail), then its tokens: a prompt
        with chunks left stays the chunked request; finished prompts are sampled."""
        s, queues = self.s, self.s.queues
        t0 = time.perf_counter()
        batch, riders = self.mixed.build(items, list(queues.running))
        step.add(riders)
        s.faults.before_forward()
        logits = s.runner.forward(batch)
        step.forwarded = True
        chunked = queues.chunked
        new_reqs = [r for r, _, _ in items if r is not chunked]
        cached = sum(r.kv_len for r, _, _ in items)
        new_tokens = sum(n for _, n, _ in items)
        s.stats.prefill_input_tokens += new_tokens
        s.stats.prefill_cached_tokens += sum(r.kv_len for r in new_reqs)
        s.stats.forward_steps += 1
        queues.set_chunked(None)
        done_rows, done_reqs = [], []
        for i, (req, n, _) in enumerate(items):
            req.commit_kv(n)
            if req.kv_len < req.seq_len:
                s.kv.cache_unfinished(req)
                queues.set_chunked(req)
                s.after_prefill_chunk(req)
                continue
            done_rows.append(i)
            done_reqs.append(req)
        if riders:
            self.mixed.commit_riders(riders)
            s.process_logits(logits[len(items):], riders, prefill=False)
        if done_reqs:
            s.process_logits(logits[done_rows], done_reqs, prefill=True)
        seconds = time.perf_counter() - t0
        self.chunks.observe(batch, seconds)
        _, usage = s.token_usage()
        log_prefill(len(new_reqs), new_tokens, cached, usage, queues.num_running,
                    queues.num_waiting, seconds, self.chunks.last)
