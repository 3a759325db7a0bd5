"""Prometheus series of a prefill or decode worker (prefix ``radixray:``).

Transfers are observed on the prefill side, one sample per room, from the scheduler's
record of finished rooms (taken at each load snapshot): latency is the time the sender
spent writing the room's KV, throughput its bytes over that time. Failures are counted
on the side that saw them; queue gauges show requests waiting for slots (decode
prealloc), for their KV (decode transfer), for a destination (prefill bootstrap) and
for their writes (prefill inflight).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "radixray:"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
THROUGHPUT_BUCKETS = tuple(x * 1e6 for x in (10, 50, 100, 250, 500, 750, 1000, 1500, 2000,
                                             3000, 5000, 10000, 25000))


class PDMetrics:
    def __init__(self, worker_id: str, role: str):
        self.worker_id, self.role = worker_id, role
        self.registry = CollectorRegistry(auto_describe=True)
        self.bytes = 0
        if role != "prefill":  # transfers are observed where they are written
            return
        self.latency = Histogram(PREFIX + "kv_transfer_latency_seconds", "Time the prefill "
                                 "worker's sender spent writing one request's KV.", ["worker"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry
                                 ).labels(worker_id)
        self.throughput = Histogram(PREFIX + "kv_transfer_throughput_bytes_per_second",
                                    "Bytes of one request's KV over its write time.", ["worker"],
                                    buckets=THROUGHPUT_BUCKETS, registry=self.registry
                                    ).labels(worker_id)

    def observe(self, snap: dict) -> None:
        for nbytes, seconds in snap["transfers"]:
            self.bytes += nbytes
            self.latency.observe(seconds)
            if seconds > 0:
                self.throughput.observe(nbytes / seconds)

    def families(self, snap: dict) -> list[Metric]:
        w = [self.worker_id]
        out: list[Metric] = list(self.registry.collect())
        if self.role == "prefill":
            c = CounterMetricFamily(PREFIX + "kv_transfer_bytes", "KV bytes written to decode "
                                    "workers.", labels=["worker"])
            c.add_metric(w, float(self.bytes))
            out.append(c)
        for name, key, doc in (
                ("num_bootstrap_failed_reqs", "bootstrap_failed", "Disaggregated requests "
                 "that failed before their KV moved (no destination, refused room, peer gone)."),
                ("num_transfer_failed_reqs", "transfer_failed", "Disaggregated requests whose "
                 "KV transfer failed or timed out.")):
            c = CounterMetricFamily(PREFIX + name, doc, labels=["worker", "role"])
            c.add_metric(w + [self.role], float(snap[key]))
            out.append(c)
        queues = {"prealloc": ("num_decode_prealloc_queue_reqs", "Decode requests waiting for "
                               "KV slots."),
                  "transfer": (f"num_{self.role}_transfer_queue_reqs", "Requests whose KV is "
                               "being written (prefill) or awaited (decode)."),
                  "bootstrap": ("num_prefill_bootstrap_queue_reqs", "Prefill requests waiting "
                                "for their decode worker's destination.")}
        for key, value in snap["counts"].items():
            if key in queues:
                name, doc = queues[key]
                g = GaugeMetricFamily(PREFIX + name, doc, labels=["worker"])
                g.add_metric(w, float(value))
                out.append(g)
        return out
