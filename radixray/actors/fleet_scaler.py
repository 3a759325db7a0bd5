"""The controller's autoscaler: samples each role's workers, decides
(cluster/autoscaling.py), and acts: starts a worker in a placement group of its own, or
drains one away.

A worker is removed only by draining: it leaves the router first (no new requests), its
in-flight requests finish (at most ``drain_timeout_s``; what is left then is aborted), and
only then is its actor stopped and its placement group removed, which frees its KV pool
and its node's resources. The last worker added leaves first. Only ready workers are
drained away; a starting one (perhaps waiting for a node) is left to start.

Every decision that changes a count is logged with its inputs and counted
(cluster/autoscaling_metrics.py); the last ones, and each removal, are in ``/fleet``.

The host is the :class:`~radixray.actors.controller.Controller`; this object calls its
``registry``, ``draining``, ``_launch_group``, ``_await_ready``, ``_mark_dead``,
``_refresh_load``, ``_publish``, ``_checkpoint``, ``_kill`` and ``_spawn``, and nothing
else of it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import asdict

from radixray.actors.lifecycle import every
from radixray.actors.placement import remove_group
from radixray.cluster.autoscaling import LatencyDeltas, RoleAutoscaler, role_sample
from radixray.cluster.autoscaling_metrics import AutoscalingMetrics
from radixray.cluster.errors import unwrap_ray_error
from radixray.cluster.registry import WorkerRecord

logger = logging.getLogger("radixray.controller")

DRAIN_POLL_S = 0.2
HISTORY = 50  # decisions and removals kept for /fleet


class FleetScaler:
    def __init__(self, host):
        self.host = host
        self.settings = host.cfg.fleet.autoscaling
        self.scalers = {role: RoleAutoscaler(p)
                        for role, p in host.cfg.autoscaling_policies().items()}
        self.metrics = AutoscalingMetrics(list(self.scalers))
        self.deltas = LatencyDeltas()
        self.next_index = 0  # worker slots are never reused: ids stay unambiguous
        self.last: dict[str, dict] = {}
        self.decisions: deque[dict] = deque(maxlen=HISTORY)
        self.removals: deque[dict] = deque(maxlen=HISTORY)

    def adopt(self, records: list[WorkerRecord], retiring=frozenset()) -> None:
        """The fleet's starting (or rebuilt) slots are known: new ones number after them.
        ``retiring``: the workers a restarted controller's checkpoint says were being drained
        away (never restarted, not counted as their role's; :meth:`resume_retiring`)."""
        self.next_index = max((r.index + 1 for r in records), default=0)
        for rec in records:
            rec.retiring = rec.worker_id in retiring

    def resume_retiring(self, records: list[WorkerRecord]) -> None:
        """After a controller restart: drain away, again, the workers the last controller
        was retiring (``retiring`` came back from the checkpoint); each is adopted still
        draining, and its requests in flight keep their time to finish."""
        for rec in records:
            if rec.retiring:
                logger.info("autoscaling %s: resuming the drain of %s (a controller restart)",
                            rec.role, rec.worker_id)
                self.host._spawn(self._retire(rec))

    async def run(self) -> None:
        await every(self.settings.decision_interval_s, self.step, "autoscaling round")

    async def step(self) -> None:
        """One round: refresh the loads, decide per role, act."""
        host = self.host
        if host.draining:  # the whole fleet is shutting down
            return
        await asyncio.gather(*(host._refresh_load(r) for r in host.registry.in_state("ready")))
        now = time.monotonic()
        for role, scaler in self.scalers.items():
            decision = scaler.decide(role_sample(role, list(host.registry), self.deltas, now))
            self.metrics.observe(decision)
            self.last[role] = asdict(decision)
            if decision.direction == "hold":
                if decision.proposed != decision.current:
                    logger.debug("%s", decision.describe())
                continue
            logger.info("%s", decision.describe())
            self.decisions.append({"at": time.time(), **asdict(decision)})
            if decision.direction == "up":
                for _ in range(decision.desired - decision.current):
                    host._spawn(self._add(role))
            else:
                ready = sorted((r for r in host.registry.in_state("ready") if r.role == role),
                               key=lambda r: -r.index)
                # the role keeps at least one worker to route to, whatever the count says
                victims = ready[:min(decision.current - decision.desired, len(ready) - 1)]
                for rec in victims:
                    host._spawn(self._retire(rec))

    async def _add(self, role: str) -> None:
        """Start one more worker of ``role`` (its own placement group first: on a cluster
        with an autoscaler this may wait for a node)."""
        host = self.host
        rec = host.registry.add(self.next_index, role)
        self.next_index += 1
        host._checkpoint()
        logger.info("autoscaling %s: starting %s", role, rec.worker_id)
        try:
            await host._launch_group([rec])
        except Exception as exc:  # noqa: BLE001 - the health loop restarts a dead slot
            host._mark_dead(rec, f"start-up failed: {unwrap_ray_error(exc)}")
            return
        host._checkpoint()
        await host._await_ready(rec)
        await host._publish()

    async def _retire(self, rec: WorkerRecord) -> None:
        """Drain ``rec`` away: out of routing, its requests finish, then stop it and
        release its placement group."""
        host = self.host
        rec.retiring = True
        rec.set_state("draining")
        await host._publish()
        t0 = time.monotonic()
        try:
            inflight = await rec.handle.drain.remote()
        except Exception:  # noqa: BLE001 - the actor is gone: nothing left to finish
            inflight = 0
        removal = {"worker_id": rec.worker_id, "role": rec.role, "at": time.time(),
                   "inflight_at_drain": inflight, "aborted": 0, "seconds": None}
        self.removals.append(removal)
        logger.info("autoscaling %s: draining %s away (%d request(s) in flight)", rec.role,
                    rec.worker_id, inflight)
        while True:
            busy = await self._busy(rec)
            if not busy:
                break
            if time.monotonic() - t0 > self.settings.drain_timeout_s:
                try:
                    removal["aborted"] = len(await rec.handle.abort_request.remote(None, True))
                except Exception:  # noqa: BLE001 - died meanwhile: nothing left to abort
                    pass
                logger.warning("autoscaling: %s still had %d request(s) after %.0f s: "
                               "aborted", rec.worker_id, busy, self.settings.drain_timeout_s)
                break
            await asyncio.sleep(DRAIN_POLL_S)
        host.registry.remove(rec.worker_id)
        try:
            await rec.handle.close_channels.remote()
        except Exception:  # noqa: BLE001 - already gone
            pass
        host._kill(rec)
        remove_group(rec)
        host._checkpoint()
        await host._publish()
        removal["seconds"] = round(time.monotonic() - t0, 3)
        logger.info("autoscaling %s: %s stopped after %.1f s; its placement group is "
                    "released", rec.role, rec.worker_id, removal["seconds"])

    @staticmethod
    async def _busy(rec: WorkerRecord) -> int:
        """Requests the worker still has (channels, running, queued); 0 once it is gone."""
        try:
            load = await rec.handle.load.remote()
        except Exception:  # noqa: BLE001 - died while draining: nothing left to wait for
            return 0
        return max(load.inflight, load.num_running_reqs + load.num_queue_reqs)

    def state(self) -> dict:
        """The ``/fleet`` view: policies, each role's last round, recent decisions and
        removals."""
        return {"policies": {role: asdict(s.policy) for role, s in self.scalers.items()},
                "last": self.last, "decisions": list(self.decisions),
                "removals": list(self.removals)}
