"""A fleet's size while a benchmark runs: the server's ``/metrics`` sampled every second.

Each sample holds, per role, the autoscaler's ``radixray:autoscaling_current_workers``
(workers starting or ready, not those draining away) and
``radixray:autoscaling_desired_workers``, and the ``radixray:autoscaling_decisions_total``
counters by role and direction. Beside them it keeps ``radixray:fleet_workers`` by state (starting, ready, draining, ...;
all roles together), read live at each scrape: it shows when an added worker starts to
serve and how long a drained one lingers. A fixed fleet reports the same series (desired = current
= its workers, no decisions), so every radixray fleet reads alike; an autoscaled fleet
sets them at each decision round, so they are absent until its first round.

Worker-seconds integrate the sampled counts as a step function: a sample's count holds
until the next sample of that role; before a role's first sample its first count holds.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field

CURRENT = "radixray:autoscaling_current_workers"
DESIRED = "radixray:autoscaling_desired_workers"
DECISIONS = "radixray:autoscaling_decisions_total"
STATES = "radixray:fleet_workers"


@dataclass
class FleetSample:
    """One scrape: ``t`` (seconds; the sampler's clock until :func:`shift` moves it),
    workers per role, the decision counters keyed ``"role:direction"``, and the fleet's
    workers by state."""

    t: float
    current: dict[str, float] = field(default_factory=dict)
    desired: dict[str, float] = field(default_factory=dict)
    decisions: dict[str, float] = field(default_factory=dict)
    states: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def parse_fleet_metrics(text: str, t: float = 0.0) -> FleetSample:
    """The autoscaling series of a Prometheus text page (other series are ignored; a page
    without them gives an empty sample). Raises ValueError on text that is not the
    Prometheus exposition format."""
    from prometheus_client.parser import text_string_to_metric_families
    sample = FleetSample(t)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == STATES and "state" in s.labels:
                sample.states[s.labels["state"]] = s.value
            role = s.labels.get("role")
            if role is None:
                continue
            if s.name == CURRENT:
                sample.current[role] = s.value
            elif s.name == DESIRED:
                sample.desired[role] = s.value
            elif s.name == DECISIONS and "direction" in s.labels:
                sample.decisions[f"{role}:{s.labels['direction']}"] = s.value
    return sample


def shift(samples: list[FleetSample], origin: float) -> list[FleetSample]:
    """The samples with ``t`` counted from ``origin`` (a run's start on the same clock)."""
    return [FleetSample(s.t - origin, s.current, s.desired, s.decisions, s.states)
            for s in samples]


def roles(samples: list[FleetSample]) -> list[str]:
    """Every role any sample reports workers of, in order of first appearance."""
    return list(dict.fromkeys(r for s in samples for r in s.current))


def workers_at(samples: list[FleetSample], role: str, t: float) -> float | None:
    """``role``'s workers at time ``t``: its last sample at or before ``t``, else its first
    sample; None when no sample reports the role."""
    known = [s for s in samples if role in s.current]
    if not known:
        return None
    before = [s for s in known if s.t <= t]
    return (before[-1] if before else known[0]).current[role]


def worker_seconds(samples: list[FleetSample], start: float, end: float) -> dict[str, float]:
    """Per role, the integral of its worker count over ``[start, end]`` (samples sorted by
    ``t``, step function as the module says). Roles no sample reports are left out."""
    out = {}
    for role in roles(samples):
        cuts = sorted({start, end, *(s.t for s in samples if start < s.t < end
                                     and role in s.current)})
        out[role] = sum(workers_at(samples, role, a) * (b - a) for a, b in zip(cuts, cuts[1:]))
    return out


HELD_STATES = ("starting", "ready", "draining")  # states in which a worker holds its resources


def held_worker_seconds(samples: list[FleetSample], start: float, end: float) -> float | None:
    """The integral over ``[start, end]`` of the workers holding a placement (starting,
    ready or draining, every role: ``radixray:fleet_workers``), so unlike
    :func:`worker_seconds` a worker counts until its drain ends; None without state series."""
    held = [FleetSample(s.t, {"held": sum(s.states.get(k, 0.0) for k in HELD_STATES)})
            for s in samples if s.states]
    return worker_seconds(held, start, end).get("held")


def max_workers(samples: list[FleetSample], start: float = float("-inf"),
                end: float = float("inf")) -> dict[str, int]:
    """Per role, the most workers it had at any time in ``[start, end]`` (the count holding
    at ``start``, then each sample's), and ``total``, the most of their sum at one time;
    empty when no sample reports workers."""
    times = [start] + [s.t for s in samples if start < s.t <= end]
    out = {}
    for role in roles(samples):
        out[role] = int(max(workers_at(samples, role, t) for t in times))
    if out:
        out["total"] = int(max(sum(workers_at(samples, r, t) for r in out) for t in times))
    return out


def decisions_between(samples: list[FleetSample], start: float, end: float) -> dict[str, int]:
    """How much each decision counter (``"role:direction"``) grew between the last sample at
    or before ``start`` (or the first one) and the last one at or before ``end``."""
    inside = [s for s in samples if s.t <= end and s.decisions]
    if not inside:
        return {}
    before = [s for s in inside if s.t <= start]
    first, last = (before[-1] if before else inside[0]), inside[-1]
    return {k: int(v - first.decisions.get(k, 0.0)) for k, v in last.decisions.items()}


class FleetSampler:
    """Scrapes ``base_url``/metrics every ``interval_s`` from :meth:`start` to :meth:`stop`;
    ``t`` is ``time.perf_counter()``. The first scrape happens inside :meth:`start` (so the
    fleet at the start of what follows is known), the rest on a thread of its own. A scrape
    that fails (no answer, a non-200 status, text that does not parse) is counted in
    ``failures`` and skipped."""

    def __init__(self, base_url: str, interval_s: float = 1.0, timeout_s: float = 5.0):
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s} must be > 0")
        self.url = base_url.rstrip("/") + "/metrics"
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.samples: list[FleetSample] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-sampler", daemon=True)
        self._client = None

    def start(self) -> FleetSampler:
        import httpx
        self._client = httpx.Client(timeout=self.timeout_s)
        self._scrape()
        self._thread.start()
        return self

    def stop(self) -> list[FleetSample]:
        """Stop after the scrape in progress; the samples taken, in time order."""
        self._stop.set()
        self._thread.join()
        return list(self.samples)

    def _run(self) -> None:
        due = time.perf_counter()
        try:
            while True:
                due = max(due + self.interval_s, time.perf_counter())  # no catch-up bursts
                if self._stop.wait(max(0.0, due - time.perf_counter())):
                    return
                self._scrape()
        finally:
            self._client.close()

    def _scrape(self) -> None:
        import httpx
        t = time.perf_counter()
        try:
            resp = self._client.get(self.url)
            resp.raise_for_status()
            self.samples.append(parse_fleet_metrics(resp.text, t))
        except (httpx.HTTPError, ValueError):
            self.failures += 1
