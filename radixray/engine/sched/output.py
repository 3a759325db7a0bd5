"""How the scheduler turns a forward pass's logits into tokens, outputs and ended requests.

A mixin of :class:`~radixray.engine.sched.scheduler.Scheduler` (it reads ``sampler``,
``stop_checker``, ``runner``, ``kv``, ``running``, ``waiting``, ``chunked_req``,
``stats``, ``pd``, ``grammar``, ``overlap`` and ``on_output``): sampling with each
request's grammar mask, appending tokens and checking stops, finishing a request (its KV
back to the pool or the radix cache, or held for a step in flight under overlap
scheduling), and aborts.
"""

from __future__ import annotations

import logging
import time

import torch

from radixray.engine.faults import BATCH_FAULT_STATUS
from radixray.engine.grammar.matcher import apply_masks
from radixray.engine.request import FinishReason, Req

logger = logging.getLogger("radixray.scheduler")


class SchedulerOutput:
    # ---- results -------------------------------------------------------------------
    def _sample_and_process(self, logits: torch.Tensor, reqs: list[Req], prefill: bool) -> None:
        now = time.perf_counter()
        zero_budget = [r for r in reqs if r.remaining_new_tokens == 0]
        for r in zero_budget:
            self.finish(r, FinishReason("length", length=len(r.output_ids)))
        if zero_budget:
            keep = [i for i, r in enumerate(reqs) if not r.finished]
            logits, reqs = logits[keep], [reqs[i] for i in keep]
        if reqs:
            apply_masks(logits, reqs, self.runner.vocab_size)
            out = self.sampler.sample(logits, [r.sampling for r in reqs],
                                      [r.generator for r in reqs], [r.output_ids for r in reqs])
            self._process_sampled(out, reqs, prefill, now)
        if not prefill:
            self.running = [r for r in self.running if not r.finished]
        self.max_running_seen = max(self.max_running_seen, len(self.running))
        self.on_output(zero_budget + reqs)

    def _process_sampled(self, out, reqs: list[Req], prefill: bool, now: float) -> None:
        """Give each request its sampled token (``out``: the Sampler's output, row ``i`` for
        ``reqs[i]``), then finish it at a stop, or (prefill) start it decoding."""
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
            if prefill and req.pd is not None and self.pd is not None:
                # Prefill half of a pair: the decode worker checks stops and decodes.
                self.kv.cache_unfinished(req)
                self.pd.prefilled(req)
                continue
            reason = req.grammar.accept(token) if req.grammar is not None else None
            reason = reason or self.stop_checker.check(req, self.runner.context_len)
            if reason is not None:
                self.finish(req, reason)
            elif prefill:
                # Share the prompt's KV through the tree now, not when the request
                # ends, so requests arriving meanwhile with the same prefix hit it.
                self.kv.cache_unfinished(req)
                self.running.append(req)
        self.stats.generation_tokens += len(reqs) - len(errors)

    def finish(self, req: Req, reason: FinishReason, release: bool = True) -> None:
        """End ``req`` with ``reason``; its KV returns to the pool or cache unless
        ``release`` is False (a disaggregated request whose slots a peer may still touch:
        its side releases them later)."""
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        if release:
            self.runner.collect_routes(req)
            if self.overlap is not None and self.overlap.holds(req):
                self.overlap.defer_release(req)  # a step in flight still writes its KV
            else:
                self.kv.release(req)
        if reason.type == "abort":
            self.stats.num_aborted_reqs += 1
        self.stats.num_finished_reqs += 1
        self.stats.prompt_tokens += len(req.prompt_ids)
        if req in self.running:
            self.running.remove(req)

    def abort_all(self, message: str) -> None:
        """Abort every request, queued in the inbox ones included (the loop is not running)."""
        self._ingest()
        for req in self.held_requests():
            self.abort(req.rid, message)

    def abort(self, rid: str, message: str) -> bool:
        """Abort a waiting, prefilling or running request; its KV returns to the pool or cache."""
        if self.pd is not None and self.pd.abort(rid, message):
            return True
        queued = self.grammar.remove(rid)
        if queued is not None:
            self.finish(queued, FinishReason("abort", message=message))
            self.on_output([queued])
            return True
        for group in (self.waiting, self.running):
            for req in group:
                if req.rid == rid:
                    if group is self.waiting:
                        self.waiting.remove(req)
                    self.finish(req, FinishReason("abort", message=message))
                    self.on_output([req])
                    return True
        if self.chunked_req is not None and self.chunked_req.rid == rid:
            req, self.chunked_req = self.chunked_req, None
            self.finish(req, FinishReason("abort", message=message))
            self.on_output([req])
            return True
        return False
