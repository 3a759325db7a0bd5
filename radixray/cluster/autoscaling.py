"""Autoscaling decisions: how many workers of a role the fleet should run. Pure Python.

The controller (actors/fleet_scaler.py) calls :meth:`RoleAutoscaler.decide` once per
``fleet.autoscaling.decision_interval_s`` with a :class:`RoleSample` of the role's workers
and acts on the :class:`Decision` it returns (start a worker, or drain one away).

The rule, per role (docs/autoscaling.md):

- Each configured target is a signal. A *load* signal (in-flight requests, queued
  requests, KV usage) is a per-worker figure that adds up over workers: the fleet needs
  ``total / target`` workers for it, ``total`` averaged over ``look_back_period_s``. A
  *latency* signal (TTFT, TPOT: the mean over the requests that finished in the look-back
  window) scales with the worker count like Kubernetes' HPA: the fleet needs
  ``current * observed / target`` workers.
- Up: when any signal needs more than the current count, the proposal is the largest
  need, rounded up.
- Down (with hysteresis): each signal's need is taken at ``1 - downscale_tolerance`` of its
  target, so a fleet one smaller would still run below its target by that margin; when the
  largest of these is below the current count, that is the proposal.
- The proposal is clamped to ``[min_workers, max_workers]``; a fleet outside those bounds
  moves to them at once.
- No scale-down while a worker of the role is still starting: the load of the workers
  that serve says nothing yet about the fleet once the new one serves too, and draining
  a ready worker for a starting one could leave the role with none to route to.
- Delays, as Ray Serve's ``upscale_delay_s`` / ``downscale_delay_s``: a proposal acts only
  after proposals in the same direction have been made for that long without a break; a
  hold or the other direction starts the wait again. The applied count is the latest
  proposal. After a change the look-back window starts empty (its samples described
  another fleet).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

LOAD_SIGNALS = ("ongoing_requests", "queue_length", "kv_usage")
LATENCY_SIGNALS = ("ttft_s", "tpot_s")
EPS = 1e-9


@dataclass(frozen=True)
class RolePolicy:
    """How one role scales. ``targets``: signal name -> the per-worker target (load
    signals) or the latency target in seconds (latency signals)."""

    role: str
    min_workers: int
    max_workers: int
    targets: dict[str, float]
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_period_s: float = 30.0
    downscale_tolerance: float = 0.1

    def __post_init__(self):
        if not 0 <= self.min_workers <= self.max_workers:
            raise ValueError(f"{self.role}: need 0 <= min_workers <= max_workers, got "
                             f"{self.min_workers} and {self.max_workers}")
        unknown = set(self.targets) - set(LOAD_SIGNALS) - set(LATENCY_SIGNALS)
        if unknown or not self.targets:
            raise ValueError(f"{self.role}: targets must name some of "
                             f"{LOAD_SIGNALS + LATENCY_SIGNALS}, got {sorted(self.targets)}")


@dataclass(frozen=True)
class RoleSample:
    """One role's workers at one moment. ``workers``: the count the fleet has now (ready and
    starting, not those draining away); the load sums are over ``serving`` ready workers;
    the latency pairs are (sum, count) of the requests finished since the last sample."""

    at: float  # monotonic seconds
    workers: int
    serving: int = 0
    starting: int = 0  # of ``workers``, not ready yet
    ongoing_requests: float = 0.0
    queue_length: float = 0.0
    kv_usage: float = 0.0
    ttft_s: tuple[float, int] = (0.0, 0)
    tpot_s: tuple[float, int] = (0.0, 0)


@dataclass(frozen=True)
class Decision:
    """``direction``: up, down or hold. ``desired``: the count the fleet should move to now
    (``current`` on hold); ``proposed``: this round's clamped proposal, which a hold may be
    waiting on (``pending_s`` of its delay elapsed). ``inputs``: each signal's window value,
    target and the workers it needs, for the log."""

    role: str
    direction: str
    current: int
    desired: int
    proposed: int
    reason: str
    pending_s: float = 0.0
    inputs: dict = field(default_factory=dict)

    def describe(self) -> str:
        signals = ", ".join(f"{name}={v['value']:.3g} (target {v['target']:.3g}, needs "
                            f"{v['needs']:.2f})" for name, v in self.inputs.items())
        return (f"autoscaling {self.role}: {self.direction} {self.current} -> {self.desired} "
                f"({self.reason}); {signals or 'no signal yet'}")


class RoleAutoscaler:
    """The decision state of one role: the look-back window and the pending direction."""

    def __init__(self, policy: RolePolicy):
        self.policy = policy
        self.window: deque[RoleSample] = deque()
        self._wish: str = "hold"
        self._since: float | None = None

    def signals(self) -> dict[str, dict]:
        """Each target's value over the window and the workers it needs; a signal with no
        data in the window (no serving worker, no finished request) is left out."""
        p, out = self.policy, {}
        current = self.window[-1].workers if self.window else 0
        loaded = [s for s in self.window if s.serving > 0]
        for name, target in p.targets.items():
            if name in LOAD_SIGNALS:
                if not loaded:
                    continue
                total = sum(getattr(s, name) for s in loaded) / len(loaded)
                out[name] = {"value": total / max(loaded[-1].serving, 1), "target": target,
                             "needs": total / target}
            else:
                total = sum(getattr(s, name)[0] for s in self.window)
                count = sum(getattr(s, name)[1] for s in self.window)
                if count:
                    mean = total / count
                    out[name] = {"value": mean, "target": target,
                                 "needs": current * mean / target}
        return out

    def decide(self, sample: RoleSample) -> Decision:
        """Take ``sample`` into the window and return this round's decision."""
        p = self.policy
        self.window.append(sample)
        while self.window and self.window[0].at < sample.at - p.look_back_period_s:
            self.window.popleft()
        current = sample.workers
        inputs = self.signals()
        bounded = min(max(current, p.min_workers), p.max_workers)
        if bounded != current:  # outside the bounds: move at once, no delay
            return self._act(sample, "up" if bounded > current else "down", bounded,
                             f"outside [{p.min_workers}, {p.max_workers}]", inputs)
        up = max((math.ceil(v["needs"] - EPS) for v in inputs.values()), default=current)
        down = max((math.ceil(v["needs"] / (1 - p.downscale_tolerance) - EPS)
                    for v in inputs.values()), default=current)
        if up > current:
            proposed, direction = min(up, p.max_workers), "up"
            reason = "above target: " + ", ".join(
                n for n, v in inputs.items() if math.ceil(v["needs"] - EPS) > current)
        elif down < current:
            proposed, direction = max(down, p.min_workers), "down"
            reason = f"below target by more than {p.downscale_tolerance:.0%}"
        else:
            proposed, direction, reason = current, "hold", "within target"
        if proposed == current:
            direction = "hold"
            if reason != "within target":
                reason += f" (at the {'max' if up > current else 'min'} bound)"
        if direction == "down" and sample.starting:  # see the module docstring
            direction, reason = "hold", (f"{reason}, but {sample.starting} worker(s) still "
                                         f"starting")
        if direction != self._wish:
            self._wish, self._since = direction, sample.at
        if direction == "hold":
            return Decision(p.role, "hold", current, current, proposed if sample.starting
                            else current, reason, 0.0, inputs)
        delay = p.upscale_delay_s if direction == "up" else p.downscale_delay_s
        waited = sample.at - self._since
        if waited + EPS < delay:
            return Decision(p.role, "hold", current, current, proposed,
                            f"{reason}; {direction} after {delay:g} s ({waited:.1f} s so far)",
                            waited, inputs)
        return self._act(sample, direction, proposed, f"{reason} for {waited:.1f} s", inputs)

    def _act(self, sample: RoleSample, direction: str, desired: int, reason: str,
             inputs: dict) -> Decision:
        self.window.clear()
        self._wish, self._since = "hold", sample.at
        return Decision(self.policy.role, direction, sample.workers, desired, desired, reason,
                        0.0, inputs)


class LatencyDeltas:
    """Per worker incarnation, the cumulative (sum, count) of a latency seen last, so each
    sample carries only the requests finished since the one before."""

    def __init__(self):
        self._last: dict[tuple, tuple[float, int]] = {}

    def delta(self, key: tuple, total: float, count: int) -> tuple[float, int]:
        prev_total, prev_count = self._last.get(key, (0.0, 0))
        self._last[key] = (total, count)
        if count < prev_count:  # a new incarnation under the same key starts from zero
            return total, count
        return total - prev_total, count - prev_count


def role_sample(role: str, records, deltas: LatencyDeltas, at: float) -> RoleSample:
    """A :class:`RoleSample` of ``records`` (the controller's worker records: ``role``,
    ``state``, ``load``, ``worker_id``, ``generation``, ``retiring``) of one role. Starting
    workers count toward the current number, and so do dead ones (the controller restarts
    them in their slots); draining ones are on their way out and count for nothing, nor do
    failed ones (past their restart budget)."""
    mine = [r for r in records if r.role == role and not r.retiring]
    current = [r for r in mine if r.state in ("starting", "ready", "dead")]
    serving = [r for r in mine if r.state == "ready" and r.load is not None]
    sums = {"ttft_s": [0.0, 0], "tpot_s": [0.0, 0]}
    for r in serving:
        for name in sums:
            total, count = deltas.delta((r.worker_id, r.generation, name),
                                        getattr(r.load, name + "_sum"),
                                        getattr(r.load, name + "_count"))
            sums[name][0] += total
            sums[name][1] += count
    return RoleSample(
        at=at, workers=len(current), serving=len(serving),
        starting=sum(r.state in ("starting", "dead") for r in mine),
        ongoing_requests=sum(max(r.load.inflight, r.load.num_running_reqs
                                 + r.load.num_queue_reqs) for r in serving),
        queue_length=sum(r.load.num_queue_reqs for r in serving),
        kv_usage=sum(r.load.token_usage for r in serving),
        ttft_s=tuple(sums["ttft_s"]), tpot_s=tuple(sums["tpot_s"]))
