"""Overlap scheduling: a decode step's forward pass runs while the scheduler takes in the step
before it.

With ``enable_overlap_schedule`` a steady decode runs as a two-stage pipeline. A single
forward thread runs step ``i``'s forward pass and samples its tokens; meanwhile the
scheduler thread appends step ``i - 1``'s tokens, checks stops, streams outputs, takes
in new requests, and builds and launches step ``i + 1``. A step is launched before the
tokens it feeds are known to the scheduler: each request's input is a reference to its
row of the previous step's result, which the forward thread reads when it starts that
step (it runs steps in order, so the result is there). Torch ops release the GIL, so the
scheduler's Python work runs while the forward pass computes.

What this changes, and what it does not:

- Tokens are the same as the sequential loop's: every forward pass sees the same inputs at
  the same positions, and sampling draws from each request's generator in the same order.
- A request that finishes at step ``i - 1`` has already been launched into step ``i``:
  that row is computed and dropped (one wasted token per finishing request), and the
  request's KV is released only once step ``i`` has run (:meth:`OverlapDecoder.holds`;
  the scheduler's ``finish`` defers it). A request launched with one token to go, or
  about to reach the context length, is left out of the next step instead.
- Only plain decode steps overlap. Anything else drains the pipeline first
  (:meth:`OverlapDecoder.drain`) and runs as before: a prefill (waiting requests or a
  chunked one), a retraction for lack of KV, a control command, and requests whose
  sampling reads state the scheduler thread is still writing (penalties over the output,
  grammars, routed-expert records).

Costs: the wasted row per finishing request; one thread. What it hides is the scheduler's
own time per step (``bench overlap`` measures it).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from radixray.engine.executor.forward_batch import ForwardBatch
from radixray.engine.executor.sampler import SampleOutput, _has_penalty
from radixray.engine.request import Req
from radixray.engine.sched.decode import PlainDecoder
from radixray.engine.sched.step import StepHost, StepRecord

logger = logging.getLogger("radixray.scheduler")


@dataclass
class _Step:
    """A launched decode step: its requests (row order), their input references and the
    future of its sampled tokens."""

    reqs: list[Req]
    future: Future
    rows: dict[int, int] = field(default_factory=dict)  # id(req) -> row


@dataclass
class OverlapStats:
    """Steps run overlapped, pipeline drains, rows computed for requests that had finished,
    and the scheduler thread's seconds of work done while a forward pass ran."""

    overlapped_steps: int = 0
    drains: int = 0
    wasted_rows: int = 0
    hidden_s: float = 0.0

    def snapshot(self) -> dict:
        return {"overlapped_steps": self.overlapped_steps, "drains": self.drains,
                "wasted_rows": self.wasted_rows, "hidden_s": self.hidden_s}


def overlappable(req: Req) -> bool:
    """A request whose sampling reads nothing the scheduler thread writes meanwhile."""
    sp = req.sampling
    return not (_has_penalty(sp) or sp.return_routed_experts
                or req.grammar is not None)


class OverlapDecoder(PlainDecoder):
    """The pipeline of one scheduler (see the module docstring); scheduler thread only.
    Turns it cannot overlap run as the plain decoder's, after a drain."""

    def __init__(self, scheduler: StepHost):
        super().__init__(scheduler)
        runner = scheduler.runner
        # OpenMP's thread count is per thread: the forward thread uses the runner's.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="radixray-forward",
                                        initializer=torch.set_num_threads,
                                        initargs=(runner.num_threads,))
        self.inflight: _Step | None = None
        self._deferred: list[Req] = []  # finished, KV released once no step holds them
        self.stats = OverlapStats()

    @classmethod
    def create(cls, config, scheduler: StepHost) -> OverlapDecoder | None:
        if not config.enable_overlap_schedule:
            return None
        for name, value in (("ep_size", config.ep_size > 1),
                            ("disaggregation_mode", config.disaggregation_mode),
                            ("speculative_algorithm", config.speculative_algorithm)):
            if value:
                raise ValueError(f"enable_overlap_schedule cannot run with {name}; turn one of "
                                 f"them off")
        logger.info("overlap scheduling on: decode steps run in a forward thread while the "
                    "scheduler takes in the step before")
        return cls(scheduler)

    @property
    def busy(self) -> bool:
        """A step is in flight, or finished requests wait for one to end."""
        return self.inflight is not None or bool(self._deferred)

    def holds(self, req: Req) -> bool:
        """``req`` is in the step in flight: its KV must outlive that step."""
        return self.inflight is not None and id(req) in self.inflight.rows

    def defer_release(self, req: Req) -> None:
        self._deferred.append(req)

    def holders(self) -> list[Req]:
        """Finished requests whose KV is still held (KV conservation counts them)."""
        return list(self._deferred)

    # ---- the pipeline -------------------------------------------------------------
    def decode(self, step: StepRecord) -> None:
        """One overlapped decode step: launch the next step, then take in the one before.
        A turn that must run sequentially drains first and runs the plain step."""
        s = self.s
        queues = s.queues
        running = queues.running
        if queues.has_prefill_work or not running \
                or not all(overlappable(r) for r in running):
            self.drain()
            if queues.num_running:
                super().decode(step)
            return
        prev = self.inflight
        reqs = [r for r in running if self._has_room(r, prev)]
        if len(reqs) > s.kv.available_tokens():
            self.drain()  # the sequential step retracts
            super().decode(step)
            return
        step.add(reqs)  # a fault at launch fails these
        self.inflight = self._launch(reqs, prev) if reqs else None
        s.ratio.step()
        if prev is not None:
            busy_s = self._take_in(prev)
            if self.inflight is not None and not self.inflight.future.done():
                self.stats.hidden_s += busy_s  # all of it ran under the next forward pass
            self.stats.overlapped_steps += 1
        self._release_deferred()

    def drain(self) -> None:
        """Take in the step in flight, if any; launch none."""
        if self.inflight is None:
            self._release_deferred()
            return
        prev, self.inflight = self.inflight, None
        self.stats.drains += 1
        self._take_in(prev)
        self._release_deferred()

    def close(self) -> None:
        try:
            self.drain()
        except Exception:  # noqa: BLE001 - shutting down: the engine is going anyway
            logger.exception("overlap: the last step failed while stopping")
        self._pool.shutdown(wait=True)

    # ---- internals ----------------------------------------------------------------
    def _has_room(self, req: Req, prev: _Step | None) -> bool:
        """Whether ``req`` may be launched now: it still needs a token after the one in
        flight, and that token's position fits the context."""
        ahead = _ahead(req, prev)
        return (not req.finished and req.remaining_new_tokens > ahead
                and req.seq_len + ahead < self.s.runner.context_len)

    def _launch(self, reqs: list[Req], prev: _Step | None) -> _Step:
        s = self.s
        kv = s.kv
        slots = kv.alloc_slots(len(reqs))
        if slots is None:
            raise RuntimeError("overlap: no KV slot for a decode step that had room")
        aheads, refs = [], []
        for i, r in enumerate(reqs):
            ahead = _ahead(r, prev)
            kv.table[r.req_row, r.kv_len + r.kv_reserved] = slots[i]
            r.kv_reserved += 1
            aheads.append(ahead)
            if ahead:
                refs.append((i, prev.rows[id(r)]))
        batch = s.runner.build_decode_batch(reqs, slots, aheads)
        s.faults.before_forward()
        params = [r.sampling for r in reqs]
        generators = [r.generator for r in reqs]
        prev_future = prev.future if prev is not None else None
        future = self._pool.submit(_forward_and_sample, s.runner, s.sampler, batch, refs,
                                   prev_future, params, generators)
        return _Step(reqs, future, {id(r): i for i, r in enumerate(reqs)})

    def _take_in(self, step: _Step) -> float:
        """Wait for ``step`` and hand its tokens to the requests still running; the seconds
        this took once the tokens were there. A failed step fails its requests (and the
        step launched after it, which read its tokens)."""
        s = self.s
        try:
            out = step.future.result()
        except Exception as exc:  # noqa: BLE001 - this step's requests fail, as in a step
            failed = list(step.reqs)
            if self.inflight is not None:  # it read this step's tokens: it fails too
                later, self.inflight = self.inflight, None
                try:
                    later.future.result()
                except Exception:  # noqa: BLE001
                    pass
                failed += [r for r in later.reqs if r not in failed]
            s.fail_step(exc, failed)
            return 0.0
        t0 = time.perf_counter()
        s.stats.forward_steps += 1
        s.stats.note_decode(len(step.reqs))
        s.log_decode_interval()
        live, rows = [], []
        for i, r in enumerate(step.reqs):
            if r.req_row is not None:
                r.kv_len += 1
                r.kv_reserved -= 1
            if r.finished:
                self.stats.wasted_rows += 1
            else:
                live.append(r)
                rows.append(i)
        s.process_sampled_decode(_rows(out, rows) if live else None, live)
        return time.perf_counter() - t0

    def _release_deferred(self) -> None:
        if not self._deferred:
            return
        keep = []
        for req in self._deferred:
            if self.holds(req):
                keep.append(req)
            else:
                self.s.kv.release(req)
        self._deferred = keep


def _ahead(req: Req, prev: _Step | None) -> int:
    """Tokens ``req`` has in the step in flight ``prev`` (0 or 1)."""
    return 1 if prev is not None and id(req) in prev.rows else 0


def _forward_and_sample(runner, sampler, batch: ForwardBatch, refs, prev_future, params,
                        generators):
    """Forward thread: fill the inputs that are the previous step's tokens, run the forward
    pass and sample (no penalties: ``overlappable``)."""
    if refs:
        tokens = prev_future.result().token_ids
        for pos, row in refs:
            batch.input_ids[pos] = max(tokens[row], 0)  # -1: a failed row, dropped later
    logits = runner.forward(batch)
    return sampler.sample(logits, params, generators, [[] for _ in params])


def _rows(out, rows: list[int]):
    """The Sampler output restricted to ``rows`` (renumbered from 0)."""
    errors = {j: out.errors[i] for j, i in enumerate(rows) if out.errors and i in out.errors}
    picked = SampleOutput(token_ids=[out.token_ids[i] for i in rows], errors=errors or None)
    if out.logprobs is not None:
        picked.logprobs = [out.logprobs[i] for i in rows]
        if out.top_logprobs is not None:
            picked.top_logprobs = [out.top_logprobs[i] for i in rows]
    return picked
