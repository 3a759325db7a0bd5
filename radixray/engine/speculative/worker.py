"""The scheduler's speculative decode step: draft, verify in one forward, commit, free.

:meth:`NgramSpeculator.decode_step` (the scheduler's ``SpeculativeDecoder``) replaces a plain decode step when at least one running
request has a draft. Each request then runs an extend over ``[last token] + draft`` at
positions ``kv_len..`` with logits at every row (``ForwardBatch.all_logits``); requests
without a draft ride along with one row, sampled by the standard sampler exactly as in a
decode step.

KV bookkeeping: the verify reserves ``1 + len(draft)`` slots per request (``kv_reserved``,
so a failed step returns them with the rest of its KV). After verification ``m`` tokens
are committed (accepted drafts plus the target's token, cut at the first stop); the KV of
the last token and of the ``m - 1`` accepted drafts is valid, so ``kv_len`` grows by ``m``
and stays ``seq_len - 1`` as after a decode step; the slots of rejected drafts go straight
back to the free list. The radix cache therefore only ever receives KV of committed tokens.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from radixray.engine.executor.forward_batch import ForwardBatch, ForwardMode
from radixray.engine.executor.sampler import NONFINITE_LOGITS, _has_penalty, _wants_logprob
from radixray.engine.faults import BATCH_FAULT_STATUS
from radixray.engine.models.llama import LlamaForCausalLM
from radixray.engine.request import FinishReason, Req
from radixray.engine.speculative.ngram import NgramIndex
from radixray.engine.speculative.verify import accept_greedy, accept_sampled

if TYPE_CHECKING:
    from radixray.engine.sched.step import StepHost, StepRecord

logger = logging.getLogger("radixray.scheduler")

# Attention backends whose extend reads a cached prefix through the request table (what a
# verify forward needs); a GPU backend joins once it does.
VERIFY_BACKENDS = ("torch", "cpu_paged", "cpu_batch_invariant")


@dataclass
class SpecStats:
    """Counters of verify steps; ``accept_hist[m]``: request-verifies that committed ``m``
    tokens (index 0 unused; up to num_draft_tokens)."""

    verify_steps: int = 0  # verify forwards
    verify_reqs: int = 0  # requests verified with a draft, summed over steps
    draft_tokens: int = 0
    accepted_drafts: int = 0
    committed_tokens: int = 0  # accepted drafts plus the target's own tokens
    accept_hist: list[int] = field(default_factory=list)

    def note(self, drafted: int, committed: int) -> None:
        self.verify_reqs += 1
        self.draft_tokens += drafted
        self.accepted_drafts += committed - 1
        self.committed_tokens += committed
        while len(self.accept_hist) <= committed:
            self.accept_hist.append(0)
        self.accept_hist[committed] += 1

    @property
    def accept_length(self) -> float:
        """Tokens committed per request per verify forward (1.0 before any)."""
        return self.committed_tokens / self.verify_reqs if self.verify_reqs else 1.0

    @property
    def accept_rate(self) -> float:
        """Share of drafted tokens accepted."""
        return self.accepted_drafts / self.draft_tokens if self.draft_tokens else 0.0

    def snapshot(self) -> dict:
        return {"verify_steps": self.verify_steps, "verify_reqs": self.verify_reqs,
                "draft_tokens": self.draft_tokens, "accepted_drafts": self.accepted_drafts,
                "accept_length": self.accept_length, "accept_rate": self.accept_rate,
                "accept_length_hist": list(self.accept_hist)}


def _gather(group: list[int], starts: list[int]) -> tuple[torch.Tensor, dict[int, int]]:
    """The logits rows of the requests ``group`` (indexes into the batch whose request ``i``
    owns rows ``starts[i]:starts[i + 1]``), concatenated, and each one's first row there."""
    first, pos = {}, 0
    for i in group:
        first[i] = pos
        pos += starts[i + 1] - starts[i]
    return torch.cat([torch.arange(starts[i], starts[i + 1]) for i in group]), first


def create_speculator(config, runner) -> NgramSpeculator | None:
    """The speculator ``config`` asks for (None without speculation); ValueError naming the
    field when the runner's model or attention backend cannot verify drafts."""
    if config.speculative_algorithm is None:
        return None
    if not isinstance(runner.model, LlamaForCausalLM):
        raise ValueError(f"speculative_algorithm={config.speculative_algorithm!r} needs a model "
                         f"that returns logits at every position; {type(runner.model).__name__} "
                         "does not")
    if runner.attn_backend.name not in VERIFY_BACKENDS:
        raise ValueError(f"speculative_algorithm={config.speculative_algorithm!r} cannot run "
                         f"with attention_backend={runner.attn_backend.name!r}; use one of "
                         f"{list(VERIFY_BACKENDS)}")
    return NgramSpeculator(config)


def can_draft(req: Req) -> bool:
    """Penalties and logprobs depend on every earlier token of the step, routed-expert
    records on every computed row, a grammar's mask on the tokens before it: such
    requests decode one token per step."""
    sp = req.sampling
    return not (_has_penalty(sp) or _wants_logprob(sp) or sp.return_routed_experts
                or req.grammar is not None)


class NgramSpeculator:
    """N-gram drafts over each request's own tokens; one verify forward per step."""

    def __init__(self, config):
        self.config = config
        self.max_draft = config.speculative_num_draft_tokens - 1
        self.windows = (config.speculative_ngram_min_match_window_size,
                        config.speculative_ngram_max_match_window_size)
        self.indexes: weakref.WeakKeyDictionary[Req, NgramIndex] = weakref.WeakKeyDictionary()
        self.stats = SpecStats()

    def draft(self, req: Req, context_len: int) -> list[int]:
        """Draft tokens for ``req``'s next step: none past max_new_tokens or the context
        (the target's own token still has to fit), none for requests that cannot draft."""
        limit = min(self.max_draft, req.remaining_new_tokens - 1, context_len - req.seq_len - 1)
        if limit <= 0 or not can_draft(req):
            return []
        index = self.indexes.get(req)
        if index is None:
            index = self.indexes[req] = NgramIndex(*self.windows)
        return index.propose(req.all_ids, limit)

    # ---- the step ---------------------------------------------------------------------
    def decode_step(self, s: StepHost, reqs: list[Req], step: StepRecord) -> bool:
        """Run one verify step for the running batch ``reqs`` of scheduler ``s``; False
        (nothing done) when no request has a draft or the pool cannot hold the drafts' KV,
        and the scheduler runs a plain decode step instead."""
        reqs = list(reqs)  # finishing a request takes it out of the scheduler's batch
        drafts = [self.draft(r, s.runner.context_len) for r in reqs]
        drafted = sum(len(d) for d in drafts)
        if not drafted or s.kv.available_tokens() < len(reqs) + drafted:
            return False
        slots = []
        for r, d in zip(reqs, drafts):
            got = s.kv.extend(r, 1 + len(d))
            if got is None:
                raise RuntimeError(f"KV allocation of {1 + len(d)} verify slots failed")
            slots.append(got)
        batch = self._verify_batch(reqs, drafts, slots, s.runner.routes_experts)
        s.faults.before_forward()
        logits = s.runner.forward(batch)
        step.forwarded = True
        s.stats.forward_steps += 1
        self.stats.verify_steps += 1
        starts = [0]
        for d in drafts:
            starts.append(starts[-1] + 1 + len(d))
        committed = self._commit_drafted(s, reqs, drafts, logits, starts)
        plain = [i for i, d in enumerate(drafts) if not d]
        for i in plain:
            reqs[i].commit_kv(1)
        s.stats.note_decode(committed + len(plain))
        if plain:  # also takes finished requests out of the batch and reports them
            s.process_logits(logits[[starts[i] for i in plain]], [reqs[i] for i in plain],
                             prefill=False)
        s.report_decoded([r for r, d in zip(reqs, drafts) if d])
        s.log_decode_interval()
        if s.stats.decode_steps % s.config.decode_log_interval == 0:
            logger.info("Speculative decoding (%s): accept len %.2f, accept rate %.2f, "
                        "verify steps %d", self.config.speculative_algorithm,
                        self.stats.accept_length, self.stats.accept_rate,
                        self.stats.verify_steps)
        return True

    @staticmethod
    def _verify_batch(reqs: list[Req], drafts: list[list[int]], slots: list[torch.Tensor],
                      routes_experts: bool) -> ForwardBatch:
        ids: list[int] = []
        positions: list[int] = []
        captures = []
        for r, d in zip(reqs, drafts):
            if routes_experts and r.sampling.return_routed_experts:  # never drafts
                captures.append((r, len(ids), 1, r.kv_len))
            ids.append(r.output_ids[-1])
            ids.extend(d)
            positions.extend(range(r.kv_len, r.kv_len + 1 + len(d)))
        return ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64), out_cache_loc=torch.cat(slots),
            req_rows=torch.tensor([r.req_row for r in reqs], dtype=torch.int64),
            prefix_lens=[r.kv_len for r in reqs], extend_lens=[1 + len(d) for d in drafts],
            seq_lens=[r.kv_len + 1 + len(d) for r, d in zip(reqs, drafts)], all_logits=True,
            route_captures=captures)

    def _commit_drafted(self, s, reqs, drafts, logits, starts) -> int:
        """Verify, commit and stop-check every request with a draft; returns the tokens
        committed."""
        rows = [i for i, d in enumerate(drafts) if d]
        greedy = [i for i in rows if reqs[i].sampling.is_greedy]
        sampled = [i for i in rows if not reqs[i].sampling.is_greedy]
        if greedy:
            flat, g_first = _gather(greedy, starts)
            argmax = logits[flat].argmax(dim=-1).tolist()
        if sampled:
            flat, s_first = _gather(sampled, starts)
            x = logits[flat]
            params = [reqs[i].sampling for i in sampled for _ in range(starts[i], starts[i + 1])]
            probs = s.sampler.filtered_probs(x, x.amax(dim=-1), params, list(range(len(params))))
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        committed = 0
        for i in rows:
            req, d = reqs[i], drafts[i]
            n = 1 + len(d)
            if not all(finite[starts[i]:starts[i + 1]]):
                self._release_rejected(s, req, 0, n)
                s.finish(req, FinishReason("error", message=NONFINITE_LOGITS,
                                           status=BATCH_FAULT_STATUS))
                continue
            if req.sampling.is_greedy:
                tokens = accept_greedy(argmax[g_first[i]:g_first[i] + n], d)
            else:
                tokens = accept_sampled(probs[s_first[i]:s_first[i] + n], d, req.generator)
            committed += self._append(s, req, tokens, n)
        s.stats.generation_tokens += committed
        return committed

    def _append(self, s, req: Req, tokens: list[int], reserved: int) -> int:
        """Append ``tokens`` one by one until a stop; keep the KV of the rows that fed the
        committed tokens, free the rest. Returns the number committed."""
        reason, m = None, 0
        for t in tokens:
            req.output_ids.append(t)
            m += 1
            reason = s.stop_checker.check(req, s.runner.context_len)
            if reason is not None:
                break
        self._release_rejected(s, req, m, reserved)
        req.spec_verify_ct += 1
        req.spec_accepted_tokens += m
        self.stats.note(reserved - 1, m)
        if reason is not None:
            s.finish(req, reason)
        return m

    @staticmethod
    def _release_rejected(s, req: Req, keep: int, reserved: int) -> None:
        """Of the ``reserved`` verify slots past ``kv_len``, free all but the first ``keep``
        and commit those."""
        row, start = req.req_row, req.kv_len
        if keep < reserved:
            s.kv.allocator.free(s.kv.table[row, start + keep:start + reserved].clone())
        req.commit_kv(keep)
