"""The scheduler loop: ingest -> build a batch (prefill if one can be admitted, else decode)
-> run it -> process its tokens.

The scheduler owns the engine's request state and is driven from one thread. Other
threads talk to it only through ``submit`` (a thread-safe inbox drained between steps);
results leave through the ``on_output`` callback. Its queues (:class:`RequestQueues`)
change only through its own methods: the parts that build and run a step
(:class:`PrefillBuilder`, the decoders of decode.py and overlap.py, the speculative
worker), the disaggregated sides and the control verbs ask it to enqueue, start, retract,
finish or abort a request.

A step that raises fails its own batch and the loop goes on; repeated failures make the
engine failed (see :mod:`radixray.engine.sched.failures`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from radixray.engine.config import EngineConfig
from radixray.engine.ep.group import IDLE_POLL_S
from radixray.engine.executor.model_runner import ModelRunner
from radixray.engine.executor.sampler import DETERMINISTIC_DEFAULT_SEED, Sampler
from radixray.engine.faults import ENGINE_FAILED_STATUS, StepFaults, describe
from radixray.engine.grammar.manager import GrammarManager, GrammarWake
from radixray.engine.mem_cache.factory import create_kv_manager
from radixray.engine.mem_cache.kv_audit import KVAudit
from radixray.engine.mem_cache.kv_manager import KVManager
from radixray.engine.request import FinishReason, Req
from radixray.engine.request_ids import belongs_to
from radixray.engine.sched.admission import NewTokenRatio, reserved_for_running
from radixray.engine.sched.decode import PlainDecoder, SpeculativeDecoder
from radixray.engine.sched.failures import StepFailures
from radixray.engine.sched.inbox import AbortCommand, CallInLoop, Inbox
from radixray.engine.sched.lora import active_adapters, adopt_adapter
from radixray.engine.sched.output import OutputProcessor, ProcessedStep
from radixray.engine.sched.overlap import OverlapDecoder
from radixray.engine.sched.pause import pause_in_mode, resume_scheduling
from radixray.engine.sched.prefill import PrefillBuilder
from radixray.engine.sched.queues import RequestQueues
from radixray.engine.sched.stats import SchedulerStats, log_decode
from radixray.engine.sched.step import StepRecord
from radixray.engine.speculative.worker import create_speculator
from radixray.engine.stop import StopChecker

logger = logging.getLogger("radixray.scheduler")


class Scheduler:
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
        self.stop_checker = stop_checker
        self.on_output = on_output
        self.ratio = NewTokenRatio(config.schedule_conservativeness)
        self.stats = SchedulerStats()
        self.kv_audit = KVAudit(config.kv_audit_interval_steps)
        self.queues = RequestQueues()
        self.inbox = Inbox()
        self.max_running = runner.max_running_requests
        # Optional observer called with the scheduler after every step (tests, tracing).
        self.on_step: Callable[[Scheduler], None] | None = None
        # Called once, on the scheduler thread, with the reason when the engine fails.
        self.on_failed: Callable[[str], None] | None = None
        self.faults = StepFaults(config.max_consecutive_failed_steps)
        self.failures = StepFailures(self.faults, self.queues.remove, self.finish,
                                     on_output, self.held_requests, self._engine_failed)
        self.output = OutputProcessor(sampler or Sampler(runner.vocab_size), stop_checker, self.kv, self.stats,
                                      runner.vocab_size, runner.context_len, self.finish)
        self.paused: str | None = None  # the pause mode while generation is paused
        # Tags whose memory is released (the engine's MemorySaver keeps this set).
        self.memory_released: set[str] = set()
        # The prefill or decode half of a disaggregated pair (engine/disaggregation/), or
        # None for a unified engine: see attach_pd.
        self.pd = None
        # This engine's expert-parallel group (engine/ep/group.py): its ranks step together.
        self.ep = getattr(runner, "ep", None)
        # structured output: requests wait here until their grammar compiles (engine/grammar/)
        self.grammar = GrammarManager.create(config, stop_checker, runner.vocab_size,
                                             lambda: self.inbox.put(GrammarWake()))
        self.decoder = self._create_decoder()
        self.prefill = PrefillBuilder(self)
        if getattr(runner, "lora", None) is not None:  # running requests keep their slots,
            runner.lora.pinned = lambda: active_adapters(self.queues)  # grouped by slot
            self.queues.running_order = lambda req: runner.lora.slot_index(req.lora)

    def _create_decoder(self) -> PlainDecoder:
        """The decode strategy the config asks for: overlap, speculative or plain."""
        overlap = OverlapDecoder.create(self.config, self)  # ValueError on a clash
        if overlap is not None:
            return overlap
        speculator = create_speculator(self.config, self.runner)
        return SpeculativeDecoder(self, speculator) if speculator is not None \
            else PlainDecoder(self)

    # ---- reading -------------------------------------------------------------------
    @property
    def sampler(self) -> Sampler:
        """The sampler of this scheduler's steps (its output processor's)."""
        return self.output.sampler

    @property
    def num_running(self) -> int:
        """Requests decoding now (a prefill in progress not counted)."""
        return self.queues.num_running

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue."""
        return self.queues.num_waiting

    @property
    def num_holding_kv(self) -> int:
        """Queued requests holding KV slots: the running ones and a chunked prompt."""
        return len(self.queues.active())

    def num_queued(self) -> int:
        """Requests waiting for admission: the waiting queue and the inbox's requests not yet
        taken in. Any thread (an estimate while the loop runs)."""
        return self.queues.num_waiting + self.inbox.qsize()

    @property
    def max_running_seen(self) -> int:
        """Peak number of requests decoding together."""
        return self.queues.max_running_seen

    @property
    def spec_stats(self):
        """The speculative decoder's SpecStats, or None."""
        d = self.decoder
        return d.speculator.stats if isinstance(d, SpeculativeDecoder) else None

    @property
    def overlap_stats(self):
        """The overlap pipeline's OverlapStats, or None."""
        return self.decoder.stats if isinstance(self.decoder, OverlapDecoder) else None

    @property
    def has_work(self) -> bool:
        """Something to step on (never while paused)."""
        return (self.paused is None and not self.queues.empty) or self.decoder.busy

    def token_usage(self) -> tuple[int, float]:
        used = self.kv.pool_size - self.kv.available_tokens()
        return used, used / self.kv.pool_size

    def kv_holders(self) -> list[Req]:
        """Every request that may hold KV slots now."""
        holders = self.queues.active() + self.decoder.holders()
        return holders + self.pd.holders() if self.pd is not None else holders

    def check_kv_conservation(self) -> None:
        self.kv.check_conservation(self.kv_holders())

    def scheduled_requests(self) -> list[Req]:
        """The requests of the queues: waiting, running and the chunked one."""
        return self.queues.scheduled()

    def held_requests(self) -> list[Req]:
        """Every unfinished request the scheduler holds (queued, prefilling, running, the
        grammar queue's and those of a disaggregated side's rooms)."""
        reqs = self.queues.scheduled() + self.grammar.reqs
        if self.pd is not None:
            reqs = reqs + [r for r in self.pd.unfinished() if r not in reqs]
        return reqs

    def has_decode_row(self, extra: int) -> bool:
        """Whether ``extra`` more requests fit beside the running ones (max_running)."""
        return self.queues.num_running + extra < self.max_running

    def reserved_tokens(self, extra: list[Req]) -> float:
        """KV tokens the running requests and ``extra`` are forecast to still need."""
        return reserved_for_running(list(self.queues.running) + extra, self.ratio.value)

    # ---- ingest --------------------------------------------------------------------
    def submit(self, item) -> None:
        """Thread-safe: a list of Req to add, an AbortCommand, a CallInLoop or a message of
        the disaggregated side."""
        self.inbox.put(item)

    def _ingest(self, block_s: float = 0.0) -> None:
        self.inbox.drain(self._handle, block_s)

    def _handle(self, item) -> None:
        if not isinstance(item, list):
            self.decoder.drain()  # commands see no step in flight
        if isinstance(item, list):
            self._take_in(item)
        elif isinstance(item, GrammarWake):
            ready, failed = self.grammar.poll()
            for req in ready:
                self.queues.enqueue(req)
            for req, reason in failed:
                self.finish(req, reason)
            if failed:
                self.on_output([req for req, _ in failed])
        elif isinstance(item, AbortCommand):
            self.abort(item.rid, "aborted by request")
        elif isinstance(item, CallInLoop):
            try:
                item.future.set_result(item.fn(self))
            except Exception as exc:  # the caller sees it; the loop keeps serving
                item.future.set_exception(exc)
            finally:  # it may have swapped weights or buffers
                self.runner.model_changed()
        elif self.pd is not None and type(item) in self.pd.handlers:
            self.pd.handlers[type(item)](item)
        else:
            raise TypeError(f"unknown scheduler command {item!r}")

    def _take_in(self, reqs: list[Req]) -> None:
        """New requests: seeded, then held for their grammar, handed to the disaggregated
        side, or queued."""
        if self.faults.failed is not None:
            self.failures.fail(reqs, f"the engine failed: {self.faults.failed}",
                               ENGINE_FAILED_STATUS)
            return
        for req in reqs:
            gone = adopt_adapter(req, getattr(self.runner, "lora", None))
            if gone is not None:
                self.failures.fail([req], gone, 400)
                continue
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
                self.queues.enqueue(req)

    # ---- the loop ------------------------------------------------------------------
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
        self.decoder.close()

    # ---- one step ------------------------------------------------------------------
    def step(self) -> None:
        """One batch: prefill if one can be admitted, else decode. A fault while building,
        running or processing it fails that batch's requests (status 500) and returns."""
        step = StepRecord()
        try:
            if not self._prefill(step) and (self.queues.num_running or self.decoder.busy):
                # A named range for profilers (bench offline); free when no profiler runs.
                with torch.profiler.record_function("decode_step"):
                    self.decoder.decode(step)
            if self.config.check_kv_conservation:
                self.check_kv_conservation()
        except Exception as exc:  # noqa: BLE001 - one batch's fault must not stop the engine
            self.fail_step(exc, step.reqs)
        else:
            self.faults.note_success()
        if self.ep is not None and not step.forwarded:
            self._idle_forward()  # nothing admitted, or a fault before the forward
        self.kv_audit.after_step(self)
        if self.on_step is not None:
            self.on_step(self)

    def _prefill(self, step: StepRecord) -> bool:
        """Build and run a prefill batch if one can be admitted; whether one ran."""
        if not self.queues.has_prefill_work:
            return False
        self.decoder.drain()  # a prefill changes the batch: no decode step in flight
        items = self.prefill.build(step)
        if items:
            self.prefill.run(items, step)
        return bool(items)

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

    # ---- a step's tokens -----------------------------------------------------------
    def process_logits(self, logits: torch.Tensor, reqs: list[Req], prefill: bool) -> None:
        """Sample and process one row of ``logits`` per request of ``reqs`` (a prefill's
        finished prompts, or decoding requests), move them on and deliver their output."""
        self._apply(self.output.sample_and_process(logits, reqs, prefill,
                                                   hand_off=self.pd is not None), prefill)

    def process_sampled_decode(self, out, reqs: list[Req]) -> None:
        """Decode tokens sampled elsewhere (``out``: the Sampler's output for ``reqs``, or
        None when ``reqs`` is empty): process them, move the requests on, deliver."""
        processed = ProcessedStep() if out is None else \
            self.output.process_sampled(out, reqs, False, time.perf_counter())
        self._apply(processed, prefill=False)

    def report_decoded(self, reqs: list[Req]) -> None:
        """Decoding requests that a decoder processed itself: finished ones leave the batch;
        every one of ``reqs`` is delivered."""
        self._apply(ProcessedStep(reported=list(reqs)), prefill=False)

    def _apply(self, processed: ProcessedStep, prefill: bool) -> None:
        for req in processed.handed_off:
            self.pd.prefilled(req)
        for req in processed.started:
            self.queues.start_running(req)
        if not prefill:
            self.queues.drop_finished()
        self.on_output(processed.reported)

    def log_decode_interval(self) -> None:
        """Every ``decode_log_interval`` decode steps: the decode log line."""
        if self.stats.decode_steps % self.config.decode_log_interval == 0:
            used, usage = self.token_usage()
            self.stats.gen_throughput = self.stats.take_gen_throughput()
            log_decode(self.queues.num_running, used, usage, self.stats.gen_throughput,
                       self.queues.num_waiting, self.runner.last_step_graphed)

    # ---- moving requests -----------------------------------------------------------
    def enqueue(self, req: Req) -> None:
        """``req`` (validated, KV-free) waits for admission."""
        self.queues.enqueue(req)

    def start_running(self, req: Req) -> None:
        """``req``, whose prompt KV is in place and first token appended, decodes from now on
        (a disaggregated decode side's request once its KV arrived)."""
        self.queues.start_running(req)

    def unschedule(self, req: Req) -> None:
        """Take ``req`` out of the queues, keeping its KV (its owner releases it)."""
        self.queues.remove(req)

    def retract(self, req: Req) -> None:
        """Send a running (or chunked) request back to the waiting queue; its KV is freed
        (or cached)."""
        self.queues.remove(req)
        self.kv.release(req)
        req.reset_for_retraction()
        self.stats.num_retracted_reqs += 1
        self.queues.enqueue(req)

    def finish(self, req: Req, reason: FinishReason, release: bool = True) -> None:
        """End ``req`` with ``reason`` and take it out of the queues; its KV returns to the
        pool or cache unless ``release`` is False (a disaggregated request whose slots a peer
        may still touch: its side releases them later)."""
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        if release:
            self.runner.collect_routes(req)
            if self.decoder.holds(req):
                self.decoder.defer_release(req)  # a step in flight still writes its KV
            else:
                self.kv.release(req)
        if reason.type == "abort":
            self.stats.num_aborted_reqs += 1
        self.stats.num_finished_reqs += 1
        self.stats.prompt_tokens += len(req.prompt_ids)
        self.queues.remove(req)

    def end_request(self, req: Req, reason: FinishReason, release: bool = True) -> None:
        """:meth:`finish` ``req`` and deliver it."""
        self.finish(req, reason, release)
        self.on_output([req])

    def abort(self, rid: str, message: str) -> bool:
        """Abort a waiting, prefilling or running request; its KV returns to the pool or cache."""
        if self.pd is not None and self.pd.abort(rid, message):
            return True
        req = self.grammar.remove(rid) or self.queues.find(rid)
        if req is None:
            return False
        self.end_request(req, FinishReason("abort", message=message))
        return True

    def abort_matching(self, rid: str | None, message: str) -> list[str]:
        """Abort every request ``rid`` names (itself and the choices derived from it, see
        engine/request_ids.py), or every request when ``rid`` is None; the ids aborted.
        Requests still in the inbox were taken in first (the inbox is FIFO)."""
        aborted = []
        for req in self.held_requests():
            if not req.finished and (rid is None or belongs_to(req.rid, rid)) \
                    and self.abort(req.rid, message):
                aborted.append(req.rid)
        return aborted

    def abort_all(self, message: str) -> None:
        """Abort every request, queued in the inbox ones included (the loop is not running)."""
        self._ingest()
        self.abort_matching(None, message)

    # ---- control (engine/sched/pause.py) -------------------------------------------
    def reconfigure(self, **changes) -> None:
        """Replace config fields read per step (``chunked_prefill_size``,
        ``enable_mixed_chunk``, ``schedule_policy``, ...) between steps; benchmarks compare
        settings on one loaded engine."""
        self.config = dataclasses.replace(self.config, **changes)
        self.prefill = PrefillBuilder(self, cost=self.prefill.chunks.cost)

    def reset_stats(self) -> None:
        """Counters back to zero and a fresh new-token forecast."""
        self.stats.reset()
        self.ratio.reset()

    def pause(self, mode: str) -> int:
        """Pause in ``mode`` (see engine/sched/pause.py); how many requests it touched."""
        return pause_in_mode(self, mode)

    def resume(self) -> bool:
        """Schedule again; False if not paused (see engine/sched/pause.py)."""
        return resume_scheduling(self)

    # ---- faults --------------------------------------------------------------------
    def fail_step(self, exc: Exception, reqs: list[Req]) -> None:
        """A step (or an overlapped step taken in later) failed with ``exc``: fail ``reqs``,
        and the engine after too many faults in a row."""
        self.failures.step_fault(exc, reqs)

    def fail_engine(self, reason: str) -> None:
        """Stop serving: ``on_failed`` hears the reason once, then every held request and
        every later one ends with status 503. Later calls keep the first reason."""
        self.failures.fail_engine(reason)

    def _engine_failed(self, reason: str) -> None:
        if getattr(self.runner, "eplb", None) is not None:
            self.runner.eplb.cancel(f"the engine failed: {reason}")
        if self.on_failed is not None:
            self.on_failed(reason)

    # ---- prefill-decode disaggregation (engine/disaggregation/) --------------------
    def attach_pd(self, side) -> None:
        """Make this scheduler the prefill or decode half of a pair (``side``)."""
        self.pd = side

    def after_prefill_chunk(self, req: Req) -> None:
        """A chunk of ``req``'s prompt is in the pool: a prefill side sends what it can."""
        if req.pd is not None and self.pd is not None:
            self.pd.after_chunk(req)
