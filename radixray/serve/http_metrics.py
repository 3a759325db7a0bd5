"""Ingress-side HTTP series: how long each answered request took, by route, method and status.

The duration runs from the request's arrival at the ingress replica to its last body
byte, so a streamed completion counts its whole stream and a refused one its refusal.
Routes are FastAPI's templates (``/fleet/workers/{worker_id}/drain``), never raw paths;
a path no route matched is ``other``, so a scanner cannot grow the series without bound.

Each replica keeps its own registry (:func:`replica_metrics`, one per process: Serve runs
one replica per actor). The replica's heartbeat carries its families to the controller
(serve/fleet.py ``start_heartbeats``), so ``/metrics`` on any replica shows every live
replica's series, each with its ``replica`` label.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import Metric

from radixray.cluster.metrics import PREFIX

# sub-second for the admin and health routes, minutes for long generations and streams
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
UNMATCHED_ROUTE = "other"


class HttpMetrics:
    """One replica's HTTP latency histogram."""

    def __init__(self, replica: str = "ingress"):
        self.replica = replica
        self.registry = CollectorRegistry(auto_describe=True)
        self.duration = Histogram(
            PREFIX + "http_request_duration_seconds", "Seconds from a request's arrival at the "
            "ingress replica to its last response byte (a stream's whole life), by route "
            "template, method and status.", ["replica", "route", "method", "status"],
            buckets=HTTP_BUCKETS, registry=self.registry)

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.duration.labels(self.replica, route, method, str(status)).observe(seconds)

    def families(self) -> list[Metric]:
        """Plain picklable families (sent to the controller with each heartbeat)."""
        return list(self.registry.collect())


HTTP_METRICS = HttpMetrics()


def replica_metrics() -> HttpMetrics:
    """This process' :data:`HTTP_METRICS`. Callers outside this module go through here, not
    the name: Serve ships the ingress class to its replica pickled by value, and an
    object it refers to by name would arrive as a copy nobody records into."""
    return HTTP_METRICS


class HttpMetricsMiddleware:
    """Pure ASGI middleware timing every HTTP request into :data:`HTTP_METRICS` (a
    ``BaseHTTPMiddleware`` would end the timing when a stream's headers leave). A request
    whose handler raised before answering counts as status 500; one whose client went
    away mid-stream keeps the status it was sent with."""

    def __init__(self, app, metrics: HttpMetrics | None = None):
        self.app = app
        self.metrics = metrics or replica_metrics()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        state = {"status": 500, "observed": False}

        def observe() -> None:
            if not state["observed"]:
                state["observed"] = True
                route = scope.get("route")
                self.metrics.observe(getattr(route, "path", None) or UNMATCHED_ROUTE,
                                     scope.get("method", "GET"), state["status"],
                                     time.perf_counter() - start)

        async def send_observing(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                observe()  # before the last byte leaves: a client that saw it sees the count
            await send(message)

        try:
            await self.app(scope, receive, send_observing)
        finally:
            observe()  # the handler raised, or the client left mid-stream
