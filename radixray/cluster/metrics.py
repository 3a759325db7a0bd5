"""Prometheus series (prefix ``radixray:``).

Worker side: :class:`WorkerMetrics` keeps one registry per EngineWorker. Request
histograms are observed as updates leave the worker; scheduler counters and
gauges are read from the engine's snapshot at scrape time. Every series
carries a ``worker`` label.

Ingress side: ``GET /metrics`` asks every worker for its families
(:meth:`WorkerMetrics.families`, plain picklable objects), hands them to
:class:`FleetCollector`, and renders one page that merges families of the same
name across workers.
"""

from __future__ import annotations

import time
from dataclasses import fields

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from radixray.cluster.messages import WorkerLoad
from radixray.engine.control import EngineSnapshot
from radixray.engine.messages import RequestUpdate

PREFIX = "radixray:"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2, 4, 8, 15, 30, 60, 120, 300)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2, 5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)


def worker_load(snapshot: EngineSnapshot, **worker) -> WorkerLoad:
    """A worker's load: its engine's snapshot (``Engine.snapshot()``), plus ``worker``, the
    fields only the worker knows (role, inflight, startup_seconds)."""
    names = {f.name for f in fields(WorkerLoad)}
    return WorkerLoad(**{f.name: getattr(snapshot, f.name) for f in fields(snapshot)
                         if f.name in names}, **worker)


class WorkerMetrics:
    """One worker's series: request histograms plus scheduler counters/gauges. ``slo_ttft_s``
    and ``slo_tpot_s``: the targets a finished request must meet both of to count as
    goodput (server.slo_ttft_s / server.slo_tpot_s)."""

    def __init__(self, worker_id: str, slo_ttft_s: float = 2.0, slo_tpot_s: float = 0.1):
        self.worker_id = worker_id
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.registry = CollectorRegistry(auto_describe=True)
        lab = ["worker"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time from arrival at the "
                              "worker to the first output token.", lab, buckets=TTFT_BUCKETS,
                              registry=self.registry).labels(worker_id)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Gap between two consecutive "
                             "output updates of one request (an update can carry several tokens).",
                             lab, buckets=ITL_BUCKETS, registry=self.registry).labels(worker_id)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from arrival to finish.",
                             lab, buckets=E2E_BUCKETS, registry=self.registry).labels(worker_id)
        self.queue_time = Histogram(PREFIX + "queue_time_seconds", "Time from arrival to the first "
                                    "admission into a prefill batch.", lab, buckets=TTFT_BUCKETS,
                                    registry=self.registry).labels(worker_id)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Per request: time "
                              "from its first to its last token over the tokens after the "
                              "first.", lab, buckets=ITL_BUCKETS, registry=self.registry
                              ).labels(worker_id)
        self.requests = Counter(PREFIX + "requests", "Finished requests by finish reason.",
                                ["worker", "finish_reason"], registry=self.registry)
        self.goodput = Counter(PREFIX + "goodput_requests", "Requests that finished (stop or "
                               "length) within both SLOs: time to first token at most "
                               "server.slo_ttft_s and time per output token at most "
                               "server.slo_tpot_s. rate() of it is the goodput.", lab,
                               registry=self.registry).labels(worker_id)
        slo = Gauge(PREFIX + "slo_target_seconds", "The SLO targets goodput is counted "
                    "against (server.slo_ttft_s, server.slo_tpot_s).", ["worker", "slo"],
                    registry=self.registry)
        slo.labels(worker_id, "ttft").set(slo_ttft_s)
        slo.labels(worker_id, "tpot").set(slo_tpot_s)
        self._last_update: dict[str, float] = {}
        self.latency = {"ttft_s_sum": 0.0, "ttft_s_count": 0, "tpot_s_sum": 0.0,
                        "tpot_s_count": 0}  # WorkerLoad's latency totals

    def observe(self, updates: list[RequestUpdate]) -> None:
        """Record one step's updates."""
        now = time.perf_counter()
        last = self._last_update
        for u in updates:
            rid = u.rid
            prev = last.get(rid)
            if prev is not None and u.ids:
                self.itl.observe(now - prev)
            meta = u.meta
            if meta is None:
                if u.ids:
                    last[rid] = now
                continue
            last.pop(rid, None)
            if meta.first_token_latency is not None:
                self.latency["ttft_s_sum"] += meta.first_token_latency
                self.latency["ttft_s_count"] += 1
            for seconds, hist in ((meta.first_token_latency, self.ttft),
                                  (meta.e2e_latency, self.e2e), (meta.queue_time, self.queue_time)):
                if seconds is not None:
                    hist.observe(seconds)
            tpot = None
            if meta.completion_tokens > 1 and meta.e2e_latency is not None \
                    and meta.first_token_latency is not None:
                tpot = (meta.e2e_latency - meta.first_token_latency) / (meta.completion_tokens - 1)
                self.tpot.observe(tpot)
                self.latency["tpot_s_sum"] += tpot
                self.latency["tpot_s_count"] += 1
            reason = meta.finish_reason.type if meta.finish_reason else "unknown"
            self.requests.labels(self.worker_id, reason).inc()
            if reason in ("stop", "length") and meta.first_token_latency is not None \
                    and meta.first_token_latency <= self.slo_ttft_s \
                    and (tpot is None or tpot <= self.slo_tpot_s):
                self.goodput.inc()

    def forget(self, rid: str) -> None:
        self._last_update.pop(rid, None)

    def families(self, snapshot: WorkerLoad) -> list[Metric]:
        """Every family of this worker, scheduler series taken from ``snapshot``."""
        w = [self.worker_id]
        out: list[Metric] = list(self.registry.collect())
        for name, doc in (("num_running_reqs", "Requests in the running (decode) batch."),
                          ("num_queue_reqs", "Requests waiting for admission.")):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["worker", "role"])
            g.add_metric(w + [snapshot.role], float(getattr(snapshot, name)))
            out.append(g)
        total = snapshot.prefill_input_tokens + snapshot.prefill_cached_tokens
        for name, value, doc in (
                ("num_used_tokens", snapshot.num_used_tokens, "KV slots in use (requests + "
                 "cache)."),
                ("max_total_num_tokens", snapshot.max_total_num_tokens, "The KV pool's size in "
                 "tokens."),
                ("cache_hit_rate", snapshot.prefill_cached_tokens / total if total else 0.0,
                 "Prompt tokens served from the radix cache over all prompt tokens prefilled, "
                 "since start (rate() of prefill_effective_tokens gives it over a window)."),
                ("startup_seconds", snapshot.startup_seconds, "Seconds the worker took to start "
                 "(model load, KV pool, warm-up)."),
                ("weight_load_seconds", snapshot.weight_load_seconds, "Seconds the model's "
                 "weights took to load at start."),
                ("kv_slot_leak", snapshot.kv_slot_leak, "KV slots the last accounting audit "
                 "could not place (pool - free - request-held - cache-held; 0 when sound; "
                 "engine.kv_audit_interval_steps).")):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["worker"])
            g.add_metric(w, float(value))
            out.append(g)
        for name, doc in (("token_usage", "Share of the KV pool in use (requests + cache)."),
                          ("gen_throughput", "Decode tokens per second over the last log interval."),
                          ("engine_failed", "1 once the engine stopped serving after repeated "
                           "step faults (the controller then restarts the worker).")):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["worker"])
            g.add_metric(w, float(getattr(snapshot, name)))
            out.append(g)
        out += weight_version_families(w, snapshot.weight_version)
        for name, key, doc in (
                ("prompt_tokens", "prompt_tokens", "Prompt tokens of requests."),
                ("generation_tokens", "generation_tokens", "Generated tokens."),
                ("num_retracted_reqs", "num_retracted_reqs", "Requests retracted to free KV."),
                ("num_aborted_reqs", "num_aborted_reqs", "Requests aborted."),
                ("failed_steps", "failed_steps", "Scheduler steps whose batch failed with an "
                 "error (its requests finished with finish_reason error).")):
            c = CounterMetricFamily(PREFIX + name, doc, labels=["worker"])
            c.add_metric(w, float(getattr(snapshot, key)))
            out.append(c)
        out += hicache_families(w, snapshot)
        if snapshot.eplb is not None:
            g = GaugeMetricFamily(PREFIX + "eplb_balancedness", "Expert load balance of the "
                                  "current placement on the last eplb_window_size forward "
                                  "passes: mean over max of the per-rank load (1 = even).",
                                  labels=["worker"])
            g.add_metric(w, snapshot.eplb["balancedness"])
            c = CounterMetricFamily(PREFIX + "eplb_rebalances", "Expert rebalances run.",
                                    labels=["worker"])
            c.add_metric(w, float(snapshot.eplb["rebalances"]))
            out += [g, c]
        if snapshot.grammar is not None:
            out += grammar_families(w, snapshot.grammar)
        if snapshot.spec is not None:
            out += spec_families(w, snapshot.spec)
        return out


def weight_version_families(w: list[str], version: int | str) -> list[Metric]:
    """The served weight version: ``weight_version_info`` always (the version as a label,
    value 1), and the ``weight_version`` gauge while the version is an int (a string label
    such as "v1" has no number; the gauge is then absent)."""
    info = GaugeMetricFamily(PREFIX + "weight_version_info", "The version of the weights the "
                             "worker serves, as the weight_version label (an int or a string "
                             "label such as a step tag); the value is always 1.",
                             labels=["worker", "weight_version"])
    info.add_metric(w + [str(version)], 1.0)
    if not isinstance(version, int):
        return [info]
    g = GaugeMetricFamily(PREFIX + "weight_version", "The integer version of the weights the "
                          "worker serves (0: as loaded; each integer update names a greater "
                          "one); absent while a string label serves (see weight_version_info).",
                          labels=["worker"])
    g.add_metric(w, float(version))
    return [g, info]


def hicache_families(w: list[str], snapshot: WorkerLoad) -> list[Metric]:
    """prefill_effective_tokens by tier, and with the hierarchical cache its per-tier hits."""
    hc = snapshot.hicache or {}
    host, storage = hc.get("host_hit_tokens", 0), hc.get("storage_hit_tokens", 0)
    eff = CounterMetricFamily(
        PREFIX + "prefill_effective_tokens", "Prefill tokens by where their KV came from: "
        "input = computed, device_hit = the radix cache in the KV pool, host_hit / "
        "storage_hit = loaded back from the hierarchical cache's host / storage tier. Hit "
        "rate = rate(sum of *_hit) / rate(sum of all modes).", labels=["worker", "mode"])
    eff.add_metric(w + ["input"], float(snapshot.prefill_input_tokens))
    eff.add_metric(w + ["device_hit"], float(snapshot.prefill_cached_tokens - host - storage))
    eff.add_metric(w + ["host_hit"], float(host))
    eff.add_metric(w + ["storage_hit"], float(storage))
    if not hc:
        return [eff]
    hits = CounterMetricFamily(PREFIX + "hicache_hits", "Admitted requests whose prefix was "
                               "loaded back from a hierarchical cache tier.",
                               labels=["worker", "tier"])
    hits.add_metric(w + ["host"], float(hc["host_hits"]))
    hits.add_metric(w + ["storage"], float(hc["storage_hits"]))
    pool = GaugeMetricFamily(PREFIX + "hicache_host_tokens", "Host tier token slots: its "
                             "size (state=total) and those holding cached prefixes "
                             "(state=cached).", labels=["worker", "state"])
    pool.add_metric(w + ["total"], float(hc["host_pool_tokens"]))
    pool.add_metric(w + ["cached"], float(hc["host_cached_tokens"]))
    return [eff, hits, pool]


def grammar_families(w: list[str], snap: dict) -> list[Metric]:
    """Structured output's series from ``GrammarManager.snapshot()`` (labels ``w``)."""
    g = GaugeMetricFamily(PREFIX + "num_grammar_queue_reqs", "Requests waiting for their "
                          "grammar to compile (the grammar queue).", labels=["worker"])
    g.add_metric(w, float(snap["queue"]))
    out: list[Metric] = [g]
    for name, key, doc in (
            ("structured_output_requests", "requests", "Requests with a json_schema, regex, "
             "ebnf or structural_tag constraint."),
            ("grammar_compiles", "compiles", "Grammars compiled (cache misses), failed ones "
             "included."),
            ("grammar_compile_seconds", "compile_seconds", "Seconds spent compiling grammars "
             "(over grammar_compiles: the mean compile time)."),
            ("grammar_compile_failures", "compile_failures", "Grammars that did not compile."),
            ("grammar_cache_hits", "cache_hits", "Constrained requests whose grammar was "
             "already compiled or compiling.")):
        c = CounterMetricFamily(PREFIX + name, doc, labels=["worker"])
        c.add_metric(w, float(snap[key]))
        out.append(c)
    return out


def spec_families(w: list[str], spec: dict) -> list[Metric]:
    """Speculative decoding: accept length (tokens committed per request per verify
    forward) as a gauge and a histogram, the accept rate, and verify forwards."""
    g = GaugeMetricFamily(PREFIX + "spec_accept_length", "Mean tokens committed per request "
                          "per verify forward (accepted drafts + 1).", labels=["worker"])
    g.add_metric(w, spec["accept_length"])
    r = GaugeMetricFamily(PREFIX + "spec_accept_rate", "Share of draft tokens accepted.",
                          labels=["worker"])
    r.add_metric(w, spec["accept_rate"])
    c = CounterMetricFamily(PREFIX + "spec_verify_steps", "Verify forwards run.",
                            labels=["worker"])
    c.add_metric(w, float(spec["verify_steps"]))
    h = HistogramMetricFamily(PREFIX + "spec_accept_length_per_verify", "Tokens one request "
                              "committed in one verify forward.", labels=["worker"])
    hist, total, buckets = spec["accept_length_hist"], 0, []
    for m in range(1, len(hist)):
        total += hist[m]
        buckets.append((str(m), total))
    buckets.append(("+Inf", total))
    h.add_metric(w, buckets, sum_value=float(sum(m * n for m, n in enumerate(hist))))
    return [g, r, c, h]


class FleetCollector:
    """A prometheus collector that yields the latest families fetched from the workers,
    merging families of the same name (their samples carry distinct worker labels)."""

    def __init__(self):
        self._families: list[list[Metric]] = []

    def update(self, per_worker: list[list[Metric]]) -> None:
        self._families = per_worker

    def collect(self):
        merged: dict[str, Metric] = {}
        for families in self._families:
            for fam in families:
                have = merged.get(fam.name)
                if have is None:
                    copy = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                    copy.samples = list(fam.samples)
                    merged[fam.name] = copy
                else:
                    have.samples.extend(fam.samples)
        yield from merged.values()

    def describe(self):
        return []


def controller_families(registry) -> list[Metric]:
    """Fleet-level series from the controller's registry."""
    workers = GaugeMetricFamily(PREFIX + "fleet_workers", "Engine workers by state.",
                                labels=["state"])
    for state, n in registry.counts().items():
        workers.add_metric([state], float(n))
    restarts = CounterMetricFamily(PREFIX + "worker_restarts", "Times the controller restarted "
                                   "a worker after its actor died or its engine failed.",
                                   labels=["worker"])
    for rec in registry:
        restarts.add_metric([rec.worker_id], float(rec.restarts))
    return [workers, restarts]


def router_families(state: dict, retries: int) -> list[Metric]:
    """The router's series, from :meth:`radixray.cluster.routing.Router.state`."""
    picks = CounterMetricFamily(PREFIX + "router_requests", "Requests the router sent to each "
                                "worker.", labels=["worker"])
    for worker, n in sorted(state["picks"].items()):
        picks.add_metric([worker], float(n))
    decisions = CounterMetricFamily(PREFIX + "router_decisions", "Routing decisions by reason "
                                    "(cache_match, imbalance, low_match, affinity, or the "
                                    "policy's name).", labels=["reason"])
    for reason, n in sorted(state["decisions"].items()):
        decisions.add_metric([reason], float(n))
    retried = CounterMetricFamily(PREFIX + "router_retries", "Requests placed again after a "
                                  "failed or refused attempt.")
    retried.add_metric([], float(retries))
    load = GaugeMetricFamily(PREFIX + "router_worker_load", "In-flight requests the router has "
                             "sent to each worker and not yet seen finish.", labels=["worker"])
    loads = {w: s["load"] for w, s in state["workers"].items()}
    loads.update(state.get("inflight_departed", {}))
    for worker, n in sorted(loads.items()):
        load.add_metric([worker], float(n))
    out = [picks, decisions, retried, load]
    for name, value, doc in (
            ("router_open_circuits", len(state["open_circuits"]),
             "Workers skipped after consecutive failures."),
            ("router_tree_size_chars", state["tree"]["chars"],
             "Characters in the router's prefix tree."),
            ("router_tree_nodes", state["tree"]["nodes"], "Nodes in the router's prefix tree."),
            ("router_sessions", state["sessions"], "Sessions pinned to a worker.")):
        g = GaugeMetricFamily(PREFIX + name, doc)
        g.add_metric([], float(value))
        out.append(g)
    return out


UPDATE_PHASE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300)


class WeightUpdateMetrics:
    """Fleet-wide weight updates (kept by the controller): seconds per phase and outcomes,
    by ``target``: ``model`` (the base weights) or ``adapter`` (one LoRA adapter's)."""

    TARGETS = ("model", "adapter")

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        self.phase = Histogram(PREFIX + "weight_update_phase_seconds", "Seconds each phase of a "
                               "fleet-wide weight update took (pause, release, transfer, load, "
                               "commit, resume; load = fill and repack, commit = swap in), by "
                               "target: model (the base weights) or adapter (a LoRA adapter).",
                               ["phase", "target"], buckets=UPDATE_PHASE_BUCKETS,
                               registry=self.registry)
        self.updates = Counter(PREFIX + "weight_updates", "Fleet-wide weight updates by result "
                               "(ok, or failed: every worker kept the old weights) and target "
                               "(model or adapter).", ["result", "target"], registry=self.registry)
        for result in ("ok", "failed"):  # every series exists from the start (0), for alerts
            for target in self.TARGETS:
                self.updates.labels(result, target)

    def observe(self, phases: dict[str, float], ok: bool, target: str = "model") -> None:
        for phase, seconds in phases.items():
            self.phase.labels(phase, target).observe(seconds)
        self.updates.labels("ok" if ok else "failed", target).inc()

    def families(self) -> list[Metric]:
        return list(self.registry.collect())
