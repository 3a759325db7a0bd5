"""Prometheus series of the fleet autoscaler (kept by the controller, served with the
fleet's on every ingress's ``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import Metric

from radixray.cluster.autoscaling import Decision
from radixray.cluster.metrics import PREFIX


class AutoscalingMetrics:
    """Decisions by role and direction; desired and current workers per role."""

    def __init__(self, roles: list[str]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.decisions = Counter(PREFIX + "autoscaling_decisions", "Autoscaling decisions that "
                                 "changed a role's worker count, by direction (up, down).",
                                 ["role", "direction"], registry=self.registry)
        self.desired = Gauge(PREFIX + "autoscaling_desired_workers", "Workers of each role the "
                             "autoscaler's last round proposed (within the bounds).", ["role"],
                             registry=self.registry)
        self.current = Gauge(PREFIX + "autoscaling_current_workers", "Workers of each role "
                             "starting or ready (not those draining away).", ["role"],
                             registry=self.registry)
        for role in roles:  # every series exists from the start (0), for alerts and panels
            for direction in ("up", "down"):
                self.decisions.labels(role, direction)

    def observe(self, decision: Decision) -> None:
        if decision.direction in ("up", "down"):
            self.decisions.labels(decision.role, decision.direction).inc()
        self.desired.labels(decision.role).set(decision.proposed)
        self.current.labels(decision.role).set(decision.current)

    def families(self) -> list[Metric]:
        return list(self.registry.collect())


def fixed_fleet_families(counts: dict[str, int]) -> list[Metric]:
    """The same series for a fleet without autoscaling: desired = current = each role's
    workers, no decisions (so the dashboard's autoscaling panel reads any fleet)."""
    metrics = AutoscalingMetrics(list(counts))
    for role, n in counts.items():
        metrics.desired.labels(role).set(n)
        metrics.current.labels(role).set(n)
    return metrics.families()
