"""The scheduler loop: ingest -> pick a batch (prefill if one can be admitted, else decode) -> run -> process.

The scheduler owns all engine state and is driven from one thread. Other
threads talk to it only through ``submit`` (a thread-safe inbox drained between
steps); results leave through the ``on_output`` callback.

A step that raises fails its own batch and the loop goes on; repeated failures
make the engine failed (see :mod:`radixray.engine.faults`).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from radixray.engine.config import EngineConfig
from radixray.engine.ep.group import IDLE_POLL_S
from radixray.engine.executor.forward_batch import ForwardBatch
from radixray.engine.executor.model_runner import ModelRunner
from radixray.engine.executor.sampler import DETERMINISTIC_DEFAULT_SEED, Sampler
from radixray.engine.faults import ENGINE_FAILED_STATUS, StepFaults, describe
from radixray.engine.grammar.manager import GrammarManager, GrammarWake
from radixray.engine.mem_cache.factory import create_kv_manager
from radixray.engine.mem_cache.kv_audit import KVAudit
from radixray.engine.mem_cache.kv_manager import KVManager
from radixray.engine.mem_cache.radix_cache import MatchResult
from radixray.engine.request import Req
from radixray.engine.sched import mixed_batch
from radixray.engine.sched.admission import (
    AddResult,
    NewTokenRatio,
    PrefillBudget,
)
from radixray.engine.sched.failures import SchedulerFaults
from radixray.engine.sched.output import SchedulerOutput
from radixray.engine.sched.overlap import OverlapDecoder
from radixray.engine.sched.policy import InBatchPrefixes, order_waiting
from radixray.engine.sched.preemption import preempt_for, retract_for_decode
from radixray.engine.sched.stats import SchedulerStats, log_decode, log_prefill
from radixray.engine.speculative.worker import create_speculator
from radixray.engine.stop import StopChecker

logger = logging.getLogger("radixray.scheduler")


@dataclass
class AbortCommand:
    rid: str


@dataclass
class CallInLoop:
    """Run ``fn(scheduler)`` on the scheduler thread between steps; the result goes to ``future``."""

    fn: Callable[[Scheduler], object]
    future: Future


class Scheduler(SchedulerOutput, SchedulerFaults):
    """Continuous batching over one ModelRunner."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, stop_checker: StopChecker,
                 on_output: Callable[[list[Req]], None], kv: KVManager | None = None,
                 sampler: Sampler | None = None):
        """``kv`` (the slot owner, with its prefix cache) and ``sampler`` are parts a role
        may pass in; by default a radix cache over the runner's pool and the standard
        sampler."""
        self.config = config
        self.runner = runner
        self.kv = kv if kv is not None else create_kv_manager(config, runner)
        self.sampler = sampler or Sampler(runner.vocab_size)
        self.stop_checker = stop_checker
        self.on_output = on_output
        self.ratio = NewTokenRatio(config.schedule_conservativeness)
        self.stats = SchedulerStats()
        self.kv_audit = KVAudit(config.kv_audit_interval_steps)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.max_running = runner.max_running_requests
        self.max_running_seen = 0  # peak number of requests decoding together (tests, logs)
        # Optional observer called with the scheduler after every step (tests, tracing).
        self.on_step: Callable[[Scheduler], None] | None = None
        self.faults = StepFaults(config.max_consecutive_failed_steps)
        # Called once, on the scheduler thread, with the reason when the engine fails.
        self.on_failed: Callable[[str], None] | None = None
        self._batch: list[Req] = []  # the requests of the step in flight
        self.paused: str | None = None  # the pause mode while generation is paused
        # The prefill or decode half of a disaggregated pair (engine/disaggregation/), set by
        # the engine; None for a unified engine.
        self.pd = None
        # This engine's expert-parallel group (engine/ep/group.py): its ranks step together.
        self.ep = getattr(runner, "ep", None)
        self._forwarded = False  # whether the step in flight ran a forward pass
        # structured output: requests wait here until their grammar compiles (engine/grammar/)
        self.grammar = GrammarManager.create(config, stop_checker, runner.vocab_size,
                                             lambda: self.inbox.put(GrammarWake()))
        self.overlap = OverlapDecoder.create(config, self)  # engine/sched/overlap.py, or None
        self.spec = create_speculator(config, runner)  # engine/speculative/, or None

    # ---- ingest --------------------------------------------------------------------
    def submit(self, item) -> None:
        """Thread-safe: a list of Req to add, an AbortCommand or a CallInLoop."""
        self.inbox.put(item)

    def _ingest(self, block_s: float = 0.0) -> None:
        try:
            item = self.inbox.get(timeout=block_s) if block_s > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, item) -> None:
        if self.overlap is not None and not isinstance(item, list):
            self.overlap.drain()  # commands see no step in flight
        if isinstance(item, list):
            if self.faults.failed is not None:
                self._fail(item, f"the engine failed: {self.faults.failed}", ENGINE_FAILED_STATUS)
                return
            for req in item:
                seed = req.sampling.seed
                if seed is None and self.config.deterministic and not req.sampling.is_greedy:
                    seed = DETERMINISTIC_DEFAULT_SEED
                if seed is not None:
                    req.generator = torch.Generator(self.runner.device).manual_seed(seed)
                if self.grammar.hold(req):
                    continue
                if req.pd is not None and self.pd is not None:
                    self.pd.add(req)
                else:
                    self.waiting.append(req)
        elif isinstance(item, GrammarWake):
            self.grammar.admit_compiled(self)
        elif isinstance(item, AbortCommand):
            self.abort(item.rid, "aborted by request")
        elif isinstance(item, CallInLoop):
            try:
                item.future.set_result(item.fn(self))
            except Exception as exc:  # the caller sees it; the loop keeps serving
                item.future.set_exception(exc)
        elif self.pd is not None and type(item) in self.pd.handlers:
            self.pd.handlers[type(item)](item)
        else:
            raise TypeError(f"unknown scheduler command {item!r}")

    @property
    def num_running(self) -> int:
        """Requests decoding now (a prefill in progress not counted)."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue."""
        return len(self.waiting)

    def num_queued(self) -> int:
        """Requests waiting for admission: the waiting queue and the inbox's requests not yet
        taken in. Any thread (an estimate while the loop runs)."""
        return len(self.waiting) + self.inbox.qsize()

    @property
    def has_work(self) -> bool:
        """Something to step on (never while paused: see engine/sched/pause.py)."""
        return (self.paused is None and bool(self.waiting or self.running or self.chunked_req)
                or (self.overlap is not None and self.overlap.busy))

    def run_forever(self, stop: Callable[[], bool]) -> None:
        """Loop until ``stop()`` is true, sleeping on the inbox when idle. Returns only then:
        a fault inside a step fails that step's batch; one outside any batch (taking in
        commands, or failing a batch) leaves the engine in an unknown state, so it fails
        the engine, and the loop goes on refusing requests and answering control calls."""
        group_busy = False  # expert parallelism: whether any rank had work last turn
        while True:
            try:
                idle_wait = 0.05 if self.ep is None else IDLE_POLL_S
                self._ingest(block_s=0.0 if self.has_work or group_busy else idle_wait)
                if self.pd is not None:
                    self.pd.poll(time.monotonic())
                local = self.has_work
                if self.ep is None:
                    if stop():
                        return
                else:
                    group_busy, group_stops, rebalance = self._agree(local, stop())
                    if group_stops:
                        return
                    if rebalance:
                        self._rebalance_group()
                if local:
                    self.step()
                elif group_busy:
                    self._idle_forward()
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any fault
                logger.exception("scheduler loop fault outside a batch")
                self.fail_engine(f"the scheduler could not recover from {describe(exc)}")

    def _agree(self, local: bool, stopping: bool) -> tuple[bool, bool, bool]:
        """The group's (any work, any stopping, any rebalance wanted) for this turn. If the
        group is broken (a rank died, a collective timed out), the engine fails and stops
        agreeing: it answers control calls alone until the controller replaces the group."""
        eplb = self.runner.eplb
        try:
            return self.ep.agree(local, stopping, eplb is not None and eplb.wants_rebalance())
        except Exception as exc:  # noqa: BLE001 - a lost peer; say why, once
            self._group_broken(exc)
            return False, stopping, False

    def _rebalance_group(self) -> None:
        """Every rank, at the same turn: the group's expert rebalance (engine/ep/eplb.py)."""
        try:
            self.runner.eplb.rebalance_group()
        except Exception as exc:  # noqa: BLE001 - weights were moving when a peer failed
            self._group_broken(exc)

    def close(self) -> None:
        """The loop has ended: take in a decode step still in flight (overlap scheduling)."""
        if self.overlap is not None:
            self.overlap.close()

    def run_until_idle(self) -> None:
        """Drain the inbox and step until no request is left (in-process use and tests)."""
        self._ingest()
        while self.has_work or (self.paused is None and self.grammar.queue):
            if self.has_work:
                self.step()
            self._ingest(block_s=0.0 if self.has_work else 0.05)  # a grammar may be compiling

    # ---- one step ------------------------------------------------------------------
    def step(self) -> None:
        """One batch: prefill if one can be admitted, else decode. A fault while building,
        running or processing it fails that batch's requests (status 500) and returns."""
        self._batch = []
        self._forwarded = False
        try:
            if self.overlap is None or not self.overlap.step():
                items = self._build_prefill()
                if items:
                    self._run_prefill(items)
                elif self.running:
                    # A named range for profilers (bench offline); free when no profiler runs.
                    with torch.profiler.record_function("decode_step"):
                        self._run_decode()
            if self.config.check_kv_conservation:
                self.check_kv_conservation()
        except Exception as exc:  # noqa: BLE001 - one batch's fault must not stop the engine
            self._on_step_fault(exc)
        else:
            self.faults.note_success()
        self._batch = []
        if self.ep is not None and not self._forwarded:
            self._idle_forward()  # nothing admitted, or a fault before the forward
        self.kv_audit.after_step(self)
        if self.on_step is not None:
            self.on_step(self)

    def _idle_forward(self) -> None:
        """Join this step's MoE exchanges with no tokens (expert parallelism: another rank
        has work). A failure means the group lost a rank or its collectives timed out: the
        engine fails, and the group is restarted as a unit."""
        try:
            self.runner.forward_idle()
        except Exception as exc:  # noqa: BLE001 - the group is broken; say why
            self._group_broken(exc)

    def _group_broken(self, exc: Exception) -> None:
        self.ep = None
        self.fail_engine(f"expert-parallel group broken: {describe(exc)}")

    def token_usage(self) -> tuple[int, float]:
        used = self.kv.pool_size - self.kv.available_tokens()
        return used, used / self.kv.pool_size

    def kv_holders(self) -> list[Req]:
        """Every request that may hold KV slots now."""
        holders = self.running + ([self.chunked_req] if self.chunked_req else [])
        if self.overlap is not None:
            holders = holders + self.overlap.holders()
        return holders + self.pd.holders() if self.pd is not None else holders

    def check_kv_conservation(self) -> None:
        self.kv.check_conservation(self.kv_holders())

    def held_requests(self) -> list[Req]:
        """Every unfinished request the scheduler holds (queued, prefilling, running, and
        those of a disaggregated side's rooms)."""
        reqs = self.waiting + self.running + ([self.chunked_req] if self.chunked_req else [])
        reqs = reqs + self.grammar.reqs
        if self.pd is not None:
            reqs = reqs + [r for r in self.pd.unfinished() if r not in reqs]
        return reqs

    def unschedule(self, req: Req) -> None:
        """Take ``req`` out of the waiting queue, the chunked slot and the running batch
        (keeping its KV: its owner releases it)."""
        if req is self.chunked_req:
            self.chunked_req = None
        for group in (self.waiting, self.running):
            if req in group:
                group.remove(req)

    # ---- prefill -------------------------------------------------------------------
    def _build_prefill(self) -> list[tuple[Req, int, torch.Tensor]]:
        """Admit waiting requests (and continue a chunked one): (request, new tokens, their slots)."""
        if not self.waiting and self.chunked_req is None:
            return []
        self.kv.prepare_admission(self.waiting)
        budget = PrefillBudget.start(self.kv.available_tokens(), self.running, self.ratio.value,
                                     self.config.max_prefill_tokens, self.config.chunk_size)
        mixed_batch.reserve_decode_tokens(self, budget)
        in_batch = InBatchPrefixes(enabled=not self.kv.cache.disabled)
        if self.chunked_req is not None:
            req = self.chunked_req
            budget.add_chunk_continuation(req, req.seq_len - req.kv_len)
            in_batch.add(req)
            self._batch.append(req)
        if budget.rem_chunk_tokens is not None and budget.rem_chunk_tokens <= 0:
            return self._allocate(budget.added)
        # lpm matches every waiting request to order them; reuse those matches below so a
        # request is matched (and its nodes' hit counts bumped) once per turn. A preemption
        # inserts into the tree, so matches taken before it are dropped.
        matches: dict[int, MatchResult] = {}

        def prefix_len(r: Req) -> int:
            matches[id(r)] = self.kv.match(r)
            return len(matches[id(r)].slots)

        ordered = order_waiting(self.waiting, self.config.schedule_policy,
                                cache_disabled=self.kv.cache.disabled, prefix_len=prefix_len,
                                priority_first=self.config.enable_priority_scheduling)
        for req in ordered:
            match = matches.get(id(req)) or self.kv.match(req)
            if in_batch.should_defer(req, len(match.slots)):
                continue
            if len(self.running) + len(budget.added) >= self.max_running:
                if not preempt_for(self, req, budget):
                    break
                matches.clear()
                match = self.kv.match(req)
            matches.pop(id(req), None)
            extend_len = req.seq_len - len(match.slots)
            # Locking the matched prefix takes its evictable tokens out of the budget's
            # available count, so they cannot also pay for this request's new tokens.
            budget.rem_total_tokens -= self.kv.lock_cost(match)
            result = budget.try_add(req, extend_len)
            if result == AddResult.NO_TOKEN and preempt_for(self, req, budget, extend_len):
                matches.clear()
                result = budget.try_add(req, extend_len)
            if result == AddResult.NO_TOKEN and not self.running and not budget.added \
                    and extend_len < self.kv.available_tokens():
                # Nothing else runs, so the forecast can never improve: start it and let
                # retraction or the out-of-memory abort handle growth past the pool.
                result = budget.try_add(req, extend_len, force=True)
            if result in (AddResult.NO_TOKEN, AddResult.OTHER):
                break
            if not self.kv.admit(req, match):
                budget.added.pop()
                break
            if req.num_retractions == 0:
                req.cached_tokens = len(match.slots)
            if req.admit_time is None:
                req.admit_time = time.perf_counter()
            self.waiting.remove(req)
            self._batch.append(req)
            in_batch.add(req)
            if result == AddResult.CHUNKED:
                break
        return self._allocate(budget.added)

    def _allocate(self, added: list[tuple[Req, int]]) -> list[tuple[Req, int, torch.Tensor]]:
        """Reserve KV slots for each admitted chunk; requests that find none go back to waiting."""
        items = []
        for req, n in added:
            slots = self.kv.extend(req, n)
            if slots is None:
                logger.warning("KV allocation of %d tokens failed for %s; requeued", n, req.rid)
                if req is self.chunked_req:
                    self.chunked_req = None
                self.kv.release(req)
                self.waiting.insert(0, req)
                self._batch.remove(req)
                continue
            items.append((req, n, slots))
        return items

    def _run_prefill(self, items) -> None:
        t0 = time.perf_counter()
        batch, riders = mixed_batch.build(self, items)  # riders: running requests (mixed chunks)
        self.faults.before_forward()
        logits = self.runner.forward(batch)
        self._forwarded = True
        new_reqs = [r for r, _, _ in items if r is not self.chunked_req]
        cached = sum(r.kv_len for r, _, _ in items)
        new_tokens = sum(n for _, n, _ in items)
        self.stats.prefill_input_tokens += new_tokens
        self.stats.prefill_cached_tokens += sum(r.kv_len for r in new_reqs)
        self.stats.forward_steps += 1
        self.chunked_req = None
        done_rows, done_reqs = [], []
        for i, (req, n, _) in enumerate(items):
            req.commit_kv(n)
            if req.kv_len < req.seq_len:
                self.kv.cache_unfinished(req)
                self.chunked_req = req
                if req.pd is not None and self.pd is not None:
                    self.pd.after_chunk(req)
                continue
            done_rows.append(i)
            done_reqs.append(req)
        mixed_batch.finish_riders(self, logits[len(items):], riders)
        if done_reqs:
            self._sample_and_process(logits[done_rows], done_reqs, prefill=True)
        _, usage = self.token_usage()
        log_prefill(len(new_reqs), new_tokens, cached, usage, len(self.running),
                    len(self.waiting), time.perf_counter() - t0)

    # ---- decode --------------------------------------------------------------------
    def _run_decode(self) -> None:
        if self.kv.available_tokens() < len(self.running):
            retract_for_decode(self)
            if not self.running:
                return
        else:
            self.ratio.step()
        reqs = self.running
        self._batch = list(reqs)
        if self.spec is not None and self.spec.decode_step(self, reqs):
            return
        slots = self.kv.extend_decode(reqs)
        batch: ForwardBatch = self.runner.build_decode_batch(reqs, slots)
        self.faults.before_forward()
        logits = self.runner.forward(batch)
        self._forwarded = True
        self.stats.forward_steps += 1
        self.stats.note_decode(len(reqs))
        for r in reqs:
            r.commit_kv(1)
        self._sample_and_process(logits, list(reqs), prefill=False)
        self.log_decode_interval()

    def log_decode_interval(self) -> None:
        """Every ``decode_log_interval`` decode steps: the decode log line."""
        if self.stats.decode_steps % self.config.decode_log_interval == 0:
            used, usage = self.token_usage()
            self.stats.gen_throughput = self.stats.take_gen_throughput()
            log_decode(len(self.running), used, usage, self.stats.gen_throughput, len(self.waiting))

    def retract(self, req: Req) -> None:
        """Send a running request back to the waiting queue; its KV is freed (or cached)."""
        self.running.remove(req)
        self.kv.release(req)
        req.reset_for_retraction()
        self.stats.num_retracted_reqs += 1
        self.waiting.append(req)
