"""In-process EPLB: rebalance one engine's redundant expert copies from the load it saw.

:class:`ExpertBalancer` runs on the scheduler thread. After every forward pass it
moves the model's per-layer expert counters (``MoeForCausalLM.expert_load``) into a
sliding :class:`~radixray.engine.ep.eplb_stats.ExpertLoadWindow` of
``eplb_window_size`` passes. Every ``eplb_rebalance_num_iterations`` passes, or when
asked (``Engine.rebalance_experts``), it plans a placement for the window's load
(``eplb_planner.plan``, then :func:`~radixray.engine.ep.eplb_planner.keep_in_place` so
experts that may stay do), copies the expert weights into it and swaps the map
(``MoeForCausalLM.apply_placement``): all between two forward passes, so every pass
runs wholly on the old placement or wholly on the new one.

A rebalance rewrites expert weights in place, so it never overlaps a weight-update
session (``WeightUpdater.exclusive``): one that comes due while a session is open is
put off, and runs after the first forward pass once the session has ended; a request
raises :class:`RebalanceDeferred`, and ``Engine.rebalance_experts`` waits for the
session to end and asks again. ``begin_weight_update`` in turn waits while a
rebalance runs.

Under expert parallelism (``ep_size`` > 1) the ranks of a group rebalance together. Each
rank's window holds the load of its own requests; a rebalance comes due on every rank at
the same pass (idle passes count too), or is asked of one or more ranks; the scheduler
loops then agree to run it (``ExpertParallelGroup.agree``) and call
:meth:`ExpertBalancer.rebalance_group` at the same point on every rank, between two
forward passes. There the ranks or together whether any is in a weight-update session
(then none rebalances), sum their windows into the group's load, plan the same placement
from it, and move the expert weights between ranks (``engine/ep/expert_moves.py``) before
routing by it.

Costs: reading the counters each pass is one small device-to-host copy (on a GPU it
waits for the pass, which sampling does right after anyway); a periodic rebalance
runs inside the pass's step, before sampling, so that step takes longer by the
report's ``seconds`` (planning is pure Python per layer; the copy holds the moved
slots' weights once more while it runs).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass

from radixray.engine.ep.eplb_planner import keep_in_place, moves, plan
from radixray.engine.ep.eplb_stats import ExpertLoadWindow, overall_balancedness
from radixray.engine.weights.session import SESSION_OPEN

logger = logging.getLogger(__name__)

MOE_ONLY_OPTIONS = ("ep_num_redundant_experts", "enable_eplb", "enable_return_routed_experts")


def model_expert_options(config, model_class: type) -> dict:
    """The expert options ``model_class`` is built with; ValueError naming the option when a
    dense model is asked for expert placement."""
    from radixray.engine.models.moe import MoeForCausalLM
    if issubclass(model_class, MoeForCausalLM):
        return {"num_redundant_experts": config.ep_num_redundant_experts,
                "ep_size": config.ep_size, "ep_dispatch_backend": config.ep_dispatch_backend}
    for name in MOE_ONLY_OPTIONS + ("ep_size",):
        value = getattr(config, name)
        if value and not (name == "ep_size" and value == 1):
            raise ValueError(f"{name}={value!r} needs a mixture-of-experts model; "
                             f"{model_class.__name__} has no routed experts")
    return {}


class RebalanceDeferred(RuntimeError):
    """A rebalance could not run now; ``session`` is True when a weight-update session
    holds it off (it can run once the session ends)."""

    def __init__(self, reason: str, session: bool):
        super().__init__(f"expert rebalance deferred: {reason}")
        self.session = session


@dataclass(frozen=True)
class RebalanceReport:
    """One rebalance. Balancedness (mean over max of the per-rank load, averaged over MoE
    layers; each slot is a rank at ep_size 1, see ``engine/ep/expert_map.py``) is measured
    on the same load, the window's, under the old and the new placement."""

    trigger: str  # "periodic" or "request"
    balancedness_before: float
    balancedness_after: float
    experts_moved: int  # copies a rank gains (eplb_planner.moves), over the whole group
    seconds: float
    window_passes: int  # forward passes the load covers
    applied: bool  # False: the plan was no better, the old placement stays
    ranks: int = 1  # ranks of the group that rebalanced together
    local_copies: int = 0  # this rank's slots rewritten from one of its own slots
    received: int = 0  # this rank's slots rewritten with weights from another rank
    bytes_received: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


class ExpertBalancer:
    """EPLB of one MoE model (see the module docstring); scheduler thread only, except
    :meth:`ask`.

    ``exclusive()``: a context manager yielding None when weights may be rewritten now,
    else the reason (``WeightUpdater.exclusive``). ``group``: this engine's
    ``ExpertParallelGroup`` under expert parallelism, else None.
    """

    def __init__(self, model, window_size: int, every: int,
                 exclusive: Callable[[], AbstractContextManager[str | None]], group=None):
        self.model = model
        placement = model.expert_map.placement
        self.window = ExpertLoadWindow(placement.num_layers, placement.num_logical, window_size)
        self.every = every  # 0: only when asked
        self.exclusive = exclusive
        self.group = group
        self.passes = 0
        self.due = False  # a periodic rebalance waits for its session to end
        self._put_off = False  # the due one was counted as deferred already
        self.rebalances = 0
        self.deferred = 0
        self.failed = 0
        self.last: RebalanceReport | None = None
        self._waiters: list[Future] = []  # group mode: requests for the next rebalance
        self._waiters_lock = threading.Lock()
        self._broken: str | None = None  # group mode: the engine failed, none will run
        model.expert_load(reset=True)

    @classmethod
    def create(cls, config, model, exclusive, group=None) -> ExpertBalancer | None:
        """A balancer when ``config.enable_eplb`` (the model is MoE: see
        :func:`model_expert_options`), else None."""
        if not config.enable_eplb:
            return None
        if not model.moe_blocks:
            raise ValueError("enable_eplb needs routed experts; this model config has no "
                             "sparse (mixture-of-experts) layer")
        return cls(model, config.eplb_window_size, config.eplb_rebalance_num_iterations,
                   exclusive, group)

    def after_forward(self) -> None:
        """Record the pass's expert load (an idle pass of a group rank records none); when a
        rebalance is due and nothing holds it off, run it (alone), or leave it to the
        group's next agreement. A failed one is logged; the old placement keeps serving."""
        self.window.record(self.model.expert_load(reset=True))
        self.passes += 1
        if self.every and self.passes % self.every == 0:
            self.due = True
        if not self.due or self.group is not None:
            return
        try:
            self.rebalance("periodic")
        except RebalanceDeferred:
            pass
        except Exception:  # noqa: BLE001 - serving goes on with the placement it has
            self.failed += 1
            self.due = self._put_off = False
            logger.exception("expert rebalance failed; the old placement keeps serving")

    def rebalance(self, trigger: str = "request") -> RebalanceReport:
        """Alone (no group): plan for the window's load and apply it if it balances better.
        Raises :class:`RebalanceDeferred` while a session is open or the weights are
        released."""
        with self.exclusive() as blocked:
            if blocked is not None:
                self._defer(trigger, blocked)
                raise RebalanceDeferred(blocked, session=blocked == SESSION_OPEN)
            try:
                report = self._plan_and_apply(self.window.totals(), trigger)
            except _PlanFailed as exc:
                raise exc.__cause__ from None
        return self._done(report)

    # ---- expert parallelism: the group rebalances together --------------------------
    def ask(self) -> Future:
        """Any thread: a future of the group's next rebalance (its report, or the
        :class:`RebalanceDeferred` or error that stopped it). RuntimeError once the
        engine has failed."""
        future: Future = Future()
        with self._waiters_lock:
            if self._broken is not None:
                raise RuntimeError(f"no expert rebalance: {self._broken}")
            self._waiters.append(future)
        return future

    def wants_rebalance(self) -> bool:
        """This rank's vote at the group's agreement: a rebalance is due or asked for, and
        no weight-update session holds it off here (a periodic one put off is counted
        once, as alone)."""
        if not (self.due or self._waiters):
            return False
        with self.exclusive() as blocked:
            if blocked is None:
                return True
            if not self._waiters and not self._put_off:
                self._defer("periodic", blocked)
            return bool(self._waiters)  # a request hears why it waits, at once

    def rebalance_group(self) -> RebalanceReport | None:
        """Every rank of the group, at the same point of its loop (the agreement said so):
        rebalance for the group's load. A session open on any rank puts it off on all;
        an error before any weight moves (planning) fails this rebalance on every rank
        alike; one while weights move (a lost peer) is raised: the group is broken."""
        with self._waiters_lock:
            waiters, self._waiters = self._waiters, []
        try:
            with self.exclusive() as blocked:
                held, session, asked = self.group.any_of(
                    blocked is not None, blocked == SESSION_OPEN, bool(waiters))
                trigger = "request" if asked else "periodic"
                if held:
                    reason = blocked or ("a weight-update session is open on another rank"
                                         if session else "another rank cannot rewrite weights")
                    self._defer(trigger, reason)
                    _settle(waiters, error=RebalanceDeferred(reason, session=session))
                    return None
                load = self.group.total(self.window.totals())
                report = self._plan_and_apply(load, trigger)
        except _PlanFailed as exc:  # the same on every rank
            self.failed += 1
            self.due = self._put_off = False
            logger.error("expert rebalance failed before any weight moved: %s", exc.__cause__)
            _settle(waiters, error=exc.__cause__)
            return None
        except BaseException as exc:
            _settle(waiters, error=exc)
            raise
        _settle(waiters, result=report.as_dict())
        return self._done(report)

    def cancel(self, reason: str) -> None:
        """The engine failed: requests waiting for a group rebalance end with ``reason``."""
        with self._waiters_lock:
            waiters, self._waiters = self._waiters, []
            self._broken = reason
        _settle(waiters, error=RuntimeError(f"no expert rebalance: {reason}"))

    # ---- shared ----------------------------------------------------------------------
    def _plan_and_apply(self, load, trigger: str) -> RebalanceReport:
        t0 = time.perf_counter()
        old = self.model.expert_map.placement
        try:
            new = keep_in_place(old, plan(load, old.num_ranks, num_redundant=old.num_redundant))
            before, after = overall_balancedness(load, old), overall_balancedness(load, new)
        except Exception as exc:  # noqa: BLE001 - the same on every rank: nothing moved
            raise _PlanFailed() from exc
        applied = after > before + 1e-9
        moved, stats = 0, None
        if applied:
            moved = moves(old, new)
            stats = self.model.apply_placement(new)
        return RebalanceReport(
            trigger, before, after, moved, time.perf_counter() - t0, self.window.num_recorded,
            applied, ranks=self.model.expert_map.ep_size,
            local_copies=stats.local_copies if stats else 0,
            received=stats.received if stats else 0,
            bytes_received=stats.bytes_received if stats else 0)

    def _defer(self, trigger: str, reason: str) -> None:
        if trigger == "request" or not self._put_off:  # once per periodic one
            self.deferred += 1
            logger.info("expert rebalance (%s) deferred: %s", trigger, reason)
        self._put_off = self._put_off or trigger == "periodic"

    def _done(self, report: RebalanceReport) -> RebalanceReport:
        self.rebalances += 1
        self.last = report
        self.due = self._put_off = False
        logger.info("expert rebalance (%s): balancedness %.3f -> %.3f over %d forward passes, "
                    "%d experts moved (%d received from other ranks, %.1f MB), %.3f s%s",
                    report.trigger, report.balancedness_before, report.balancedness_after,
                    report.window_passes, report.experts_moved, report.received,
                    report.bytes_received / 1e6, report.seconds,
                    "" if report.applied else " (no better: not applied)")
        return report

    def balancedness(self) -> float:
        """The current placement's balancedness on the window's load (1.0 with no load); in
        a group, on this rank's own requests' load."""
        return overall_balancedness(self.window.totals(), self.model.expert_map.placement)

    def snapshot(self) -> dict:
        """Gauges and counters for metrics: current balancedness, rebalances done, put off
        and failed, and the last report."""
        return {"balancedness": self.balancedness(), "rebalances": self.rebalances,
                "deferred": self.deferred, "failed": self.failed,
                "last": self.last.as_dict() if self.last else None}


class _PlanFailed(Exception):
    """Planning raised (its ``__cause__``); no weight had moved."""


def _settle(waiters: list[Future], result=None, error: BaseException | None = None) -> None:
    for future in waiters:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def request_rebalance(balancer: ExpertBalancer | None, call_in_loop, weights,
                      timeout: float) -> dict:
    """``Engine.rebalance_experts``: run a rebalance on the scheduler thread (alone through
    ``call_in_loop``; in a group at its next agreement), waiting for open weight-update
    sessions of ``weights`` to end (at most ``timeout`` s in all)."""
    if balancer is None:
        raise ValueError("rebalance_experts needs enable_eplb=true (and a mixture-of-experts "
                         "model)")
    deadline = time.monotonic() + timeout
    while True:
        left = max(deadline - time.monotonic(), 1.0)
        try:
            if balancer.group is None:
                return call_in_loop(lambda _: balancer.rebalance("request").as_dict(),
                                    timeout=left)
            return balancer.ask().result(timeout=left)
        except FutureTimeout:
            raise TimeoutError(f"rebalance_experts: the expert-parallel group did not "
                               f"rebalance within {timeout} s") from None
        except RebalanceDeferred as exc:
            if not exc.session:
                raise ValueError(str(exc)) from None
            if not weights.wait_until_closed(max(deadline - time.monotonic(), 0.0)):
                raise TimeoutError(f"rebalance_experts: a weight-update session stayed open "
                                   f"for {timeout} s") from None
            if time.monotonic() >= deadline:
                raise TimeoutError(f"rebalance_experts: a weight-update session stayed open "
                                   f"on another rank for {timeout} s") from None
            time.sleep(0.05)  # the session may be another rank's
