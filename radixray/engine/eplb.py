"""In-process EPLB: rebalance one engine's redundant expert copies from the load it saw.

:class:`ExpertBalancer` runs on the scheduler thread. After every forward pass it
moves the model's per-layer expert counters (``MoeForCausalLM.expert_load``) into a
sliding :class:`~radixray.engine.eplb_stats.ExpertLoadWindow` of
``eplb_window_size`` passes. Every ``eplb_rebalance_num_iterations`` passes, or when
asked (``Engine.rebalance_experts``), it plans a placement for the window's load
(``eplb_planner.plan``, then :func:`~radixray.engine.eplb_planner.keep_in_place` so
experts that may stay do), copies the expert weights into it and swaps the map
(``MoeForCausalLM.apply_placement``): all between two forward passes, so every pass
runs wholly on the old placement or wholly on the new one.

A rebalance rewrites expert weights in place, so it never overlaps a weight-update
session (``WeightUpdater.exclusive``): one that comes due while a session is open is
put off, and runs after the first forward pass once the session has ended; a request
raises :class:`RebalanceDeferred`, and ``Engine.rebalance_experts`` waits for the
session to end and asks again. ``begin_weight_update`` in turn waits while a
rebalance runs.

Costs: reading the counters each pass is one small device-to-host copy (on a GPU it
waits for the pass, which sampling does right after anyway); a periodic rebalance
runs inside the pass's step, before sampling, so that step takes longer by the
report's ``seconds`` (planning is pure Python per layer; the copy holds the moved
slots' weights once more while it runs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass

from radixray.engine.eplb_planner import keep_in_place, moves, plan
from radixray.engine.eplb_stats import ExpertLoadWindow, overall_balancedness
from radixray.engine.weight_session import SESSION_OPEN

logger = logging.getLogger(__name__)

EPLB_OPTIONS = ("ep_num_redundant_experts", "enable_eplb")


def model_expert_options(config, model_class: type) -> dict:
    """The expert options ``model_class`` is built with; ValueError naming the option when a
    dense model is asked for expert placement."""
    from radixray.engine.models.moe import MoeForCausalLM
    if issubclass(model_class, MoeForCausalLM):
        if config.enable_eplb and config.ep_size > 1:
            raise ValueError(f"enable_eplb with ep_size={config.ep_size}: rebalancing moves "
                             f"experts between ranks, which is not built yet; use enable_eplb "
                             f"at ep_size 1, or ep_size > 1 without it")
        return {"num_redundant_experts": config.ep_num_redundant_experts,
                "ep_size": config.ep_size, "ep_dispatch_backend": config.ep_dispatch_backend}
    for name in EPLB_OPTIONS + ("ep_size",):
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
    layers; each slot is a rank at ep_size 1, see ``models/expert_map.py``) is measured
    on the same load, the window's, under the old and the new placement."""

    trigger: str  # "periodic" or "request"
    balancedness_before: float
    balancedness_after: float
    experts_moved: int  # copies a rank gains (eplb_planner.moves): slots rewritten at ep_size 1
    seconds: float
    window_passes: int  # forward passes the load covers
    applied: bool  # False: the plan was no better, the old placement stays

    def as_dict(self) -> dict:
        return asdict(self)


class ExpertBalancer:
    """EPLB of one in-process MoE model (see the module docstring); scheduler thread only.

    ``exclusive()``: a context manager yielding None when weights may be rewritten now,
    else the reason (``WeightUpdater.exclusive``).
    """

    def __init__(self, model, window_size: int, every: int,
                 exclusive: Callable[[], AbstractContextManager[str | None]]):
        self.model = model
        placement = model.expert_map.placement
        self.window = ExpertLoadWindow(placement.num_layers, placement.num_logical, window_size)
        self.every = every  # 0: only when asked
        self.exclusive = exclusive
        self.passes = 0
        self.due = False  # a periodic rebalance waits for its session to end
        self._put_off = False  # the due one was counted as deferred already
        self.rebalances = 0
        self.deferred = 0
        self.failed = 0
        self.last: RebalanceReport | None = None
        model.expert_load(reset=True)

    @classmethod
    def create(cls, config, model, exclusive) -> ExpertBalancer | None:
        """A balancer when ``config.enable_eplb`` (the model is MoE: see
        :func:`model_expert_options`), else None."""
        if not config.enable_eplb:
            return None
        if not model.moe_blocks:
            raise ValueError("enable_eplb needs routed experts; this model config has no "
                             "sparse (mixture-of-experts) layer")
        return cls(model, config.eplb_window_size, config.eplb_rebalance_num_iterations,
                   exclusive)

    def after_forward(self) -> None:
        """Record the pass's expert load; rebalance when one is due and nothing holds it off.
        A failed rebalance is logged and leaves the old placement serving."""
        self.window.record(self.model.expert_load(reset=True))
        self.passes += 1
        if self.every and self.passes % self.every == 0:
            self.due = True
        if not self.due:
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
        """Plan for the window's load and apply it if it balances better. Raises
        :class:`RebalanceDeferred` while a session is open or the weights are released."""
        with self.exclusive() as blocked:
            if blocked is not None:
                if trigger == "request" or not self._put_off:  # once per periodic one
                    self.deferred += 1
                    logger.info("expert rebalance (%s) deferred: %s", trigger, blocked)
                self._put_off = self._put_off or trigger == "periodic"
                raise RebalanceDeferred(blocked, session=blocked == SESSION_OPEN)
            t0 = time.perf_counter()
            load = self.window.totals()
            old = self.model.expert_map.placement
            new = keep_in_place(old, plan(load, old.num_ranks, num_redundant=old.num_redundant))
            before, after = overall_balancedness(load, old), overall_balancedness(load, new)
            applied = after > before + 1e-9
            moved = 0
            if applied:
                moved = moves(old, new)
                self.model.apply_placement(new)
            report = RebalanceReport(trigger, before, after, moved, time.perf_counter() - t0,
                                     self.window.num_recorded, applied)
        self.rebalances += 1
        self.last = report
        self.due = self._put_off = False
        logger.info("expert rebalance (%s): balancedness %.3f -> %.3f over %d forward passes, "
                    "%d experts moved, %.3f s%s", trigger, before, after, report.window_passes,
                    moved, report.seconds, "" if applied else " (no better: not applied)")
        return report

    def balancedness(self) -> float:
        """The current placement's balancedness on the window's load (1.0 with no load)."""
        return overall_balancedness(self.window.totals(), self.model.expert_map.placement)

    def snapshot(self) -> dict:
        """Gauges and counters for metrics: current balancedness, rebalances done, put off
        and failed, and the last report."""
        return {"balancedness": self.balancedness(), "rebalances": self.rebalances,
                "deferred": self.deferred, "failed": self.failed,
                "last": self.last.as_dict() if self.last else None}


def request_rebalance(balancer: ExpertBalancer | None, call_in_loop, weights,
                      timeout: float) -> dict:
    """``Engine.rebalance_experts``: run ``balancer.rebalance`` on the scheduler thread
    (``call_in_loop``), waiting for open weight-update sessions of ``weights`` to end
    (at most ``timeout`` s in all)."""
    if balancer is None:
        raise ValueError("rebalance_experts needs enable_eplb=true (and a mixture-of-experts "
                         "model)")
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call_in_loop(lambda _: balancer.rebalance("request").as_dict(),
                                timeout=max(deadline - time.monotonic(), 1.0))
        except RebalanceDeferred as exc:
            if not exc.session:
                raise ValueError(str(exc)) from None
            if not weights.wait_until_closed(max(deadline - time.monotonic(), 0.0)):
                raise TimeoutError(f"rebalance_experts: a weight-update session stayed open "
                                   f"for {timeout} s") from None
