"""Routing policy: which worker gets a request. Pure Python, no Ray, no I/O.

The ``cache_aware`` policy matches SGLang's sgl-model-gateway: a :class:`PrefixTree`
over request text guesses which worker already caches the request's prefix, and load
balance overrides the guess when the workers are clearly imbalanced. ``round_robin``,
``power_of_two`` and ``random`` are the usual baselines. All policies share session
affinity, ``exclude`` (for retries) and a per-worker :class:`CircuitBreaker`.

LoRA: a request run with an adapter has the adapter's name leading its route text
(:func:`adapter_route_text`). The prefix tree then keeps each adapter's prefixes apart
(workers never share KV across adapters), and the router prefers the workers that hold the
adapter (Ray Serve LLM's multiplexed routing) before prefix affinity, unless they are
clearly busier than the rest. Which workers hold it: what each reported last
(:meth:`Router.set_adapters_held`, the controller's health round passing on the adapters in
each worker's slots or queue), plus the adapters this router sent them since.

Load is this router's own count of in-flight requests: :meth:`Router.pick` adds one to
the chosen worker and :meth:`Router.release` takes it away, so every pick must be paired
with exactly one release.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Literal

from radixray.cluster.circuit import CircuitBreaker
from radixray.cluster.prefix_tree import PrefixTree
from radixray.engine import options
from radixray.engine.options import option

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random", "least_load")
PolicyName = Literal[POLICIES]  # for pydantic schemas (config, admin endpoint)


ADAPTER_MARK = "\x00lora:"


def adapter_route_text(text: str, adapter: str | None) -> str:
    """The route text of a request run with LoRA ``adapter`` (None: the base model's)."""
    return text if adapter is None else f"{ADAPTER_MARK}{adapter}\x00{text}"


def adapter_of(text: str) -> str | None:
    """The adapter a route text names (:func:`adapter_route_text`), or None."""
    if not text.startswith(ADAPTER_MARK):
        return None
    end = text.find("\x00", len(ADAPTER_MARK))
    return text[len(ADAPTER_MARK):end] if end > 0 else None


# a worker's adapter report keeps the adapters sent to it this long before its reading too
# (the request may reach the worker after the reading although sent before it)
ADAPTER_REPORT_MARGIN_S = 1.0


class NoWorkerAvailable(RuntimeError):
    """No worker can take the request; the message says why."""


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")


@dataclass
class RouterSettings:
    """Router knobs, declared once (the serve schema's ``router:`` section is derived from
    them); the defaults are sgl-model-gateway's. Invalid values raise ValueError naming the
    field."""

    policy: str = option("cache_aware", "how requests are spread over the workers",
                         choices=POLICIES)
    cache_threshold: float = option(0.3, "cache_aware: a match rate (matched chars / request "
                                    "chars) above this routes by cache", ge=0.0, le=1.0)
    balance_abs_threshold: int = option(64, "cache_aware: imbalanced when max - min in-flight "
                                        "load exceeds this (and the relative threshold)", ge=0)
    balance_rel_threshold: float = option(1.5, "cache_aware: ... and the max load exceeds this "
                                          "times the min", ge=1.0)
    max_tree_size: int = option(2**26, "cache_aware: characters of prefix tree per worker",
                                ge=1)
    eviction_interval_s: float = option(120.0, "seconds between prefix tree evictions", gt=0.0)
    session_affinity: bool = option(True, "the X-Session-Id header pins a conversation to a "
                                    "worker")
    max_sessions: int = option(100_000, "sessions remembered for affinity (LRU)", ge=1)
    circuit_failure_threshold: int = option(5, "consecutive failures that open a worker's "
                                            "circuit (skipped for the cooldown)", ge=1)
    circuit_cooldown_s: float = option(30.0, "seconds a worker with an open circuit is "
                                       "skipped", gt=0.0)
    adapter_slots: int = option(8, "LoRA: adapters remembered per worker between its reports "
                                "(as its engine's max_loras_per_batch); a request for one of "
                                "them goes to a worker holding it, before prefix affinity",
                                ge=1)

    def __post_init__(self) -> None:
        _check_policy(self.policy)  # the message lists every policy
        options.validate(self)


@dataclass(frozen=True)
class Decision:
    """The chosen worker and why.

    ``reason`` is one of "cache_match", "imbalance", "low_match" (cache_aware), "affinity",
    "round_robin", "power_of_two", "random", "least_load", or "adapter" (a LoRA request
    sent among the workers holding its adapter). ``match_rate`` is the best candidate's
    matched chars / request chars, set by cache_aware policy decisions only.
    """

    worker: str
    reason: str
    match_rate: float | None = None


class Router:
    """Picks a worker per request; keeps load, prefix tree, sessions and circuits.

    Not thread-safe: the owner serializes calls (one asyncio loop is enough). ``clock``
    drives circuit cooldowns, tree access times and eviction timing; ``rng`` breaks ties
    and drives the random policies (inject both for reproducible tests).
    """

    def __init__(
        self,
        settings: RouterSettings,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._workers: list[str] = []  # routable, sorted
        self._load: dict[str, int] = {}
        self._tree = PrefixTree()
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._rr_last: str | None = None
        self._breaker = CircuitBreaker(
            settings.circuit_failure_threshold, settings.circuit_cooldown_s, clock
        )
        self._last_evict = clock()
        self._reasons: Counter[str] = Counter()
        self._picks: Counter[str] = Counter()
        self._versions: dict[str, int | str] = {}  # worker -> weight version its tree entries hold
        # worker -> the LoRA adapters it holds, least recent first: its last report (value
        # None) and those this router sent it (value: when)
        self._adapters: dict[str, OrderedDict[str, float | None]] = {}

    @property
    def settings(self) -> RouterSettings:
        return self._settings

    @property
    def tree(self) -> PrefixTree:
        """The prefix tree (read it; mutating it bypasses the router's bookkeeping)."""
        return self._tree

    @property
    def workers(self) -> list[str]:
        """The routable workers, sorted."""
        return list(self._workers)

    # ------------------------------------------------------------ worker set

    def set_workers(self, workers: Collection[str]) -> None:
        """Replace the routable set (ready, not draining workers).

        A worker that left loses its tree entries, its sessions and its circuit state; its
        in-flight load stays until released (it is never picked meanwhile).
        """
        new = sorted(set(workers))
        gone = set(self._workers) - set(new)
        for worker in gone:
            self._tree.remove_worker(worker)
            self._breaker.forget(worker)
            self._adapters.pop(worker, None)
            if not self._load.get(worker):
                self._load.pop(worker, None)
        if gone:
            for session in [s for s, w in self._sessions.items() if w in gone]:
                del self._sessions[session]
        for worker in new:
            self._load.setdefault(worker, 0)
        self._workers = new

    # ------------------------------------------------------------ picking

    def pick(
        self, text: str, session_id: str | None = None, exclude: Collection[str] = ()
    ) -> Decision:
        """Choose a worker for a request with prompt ``text`` and count it as in flight.

        Candidates are the routable workers not in ``exclude`` whose circuit allows. A
        session mapped to a candidate sticks to it; otherwise the policy decides and the
        session is (re)mapped. Raises NoWorkerAvailable when there is no candidate.
        """
        candidates = self._candidates(exclude)
        s = self._settings
        decision: Decision | None = None
        use_session = s.session_affinity and session_id is not None
        if use_session:
            mapped = self._sessions.get(session_id)
            if mapped is not None and mapped in candidates:
                decision = Decision(mapped, "affinity")
                if s.policy == "cache_aware":
                    self._tree.insert(text, mapped, self._clock())
        adapter = adapter_of(text)
        if decision is None:
            holders = self._adapter_holders(adapter, candidates) if adapter else None
            decision = self._by_policy(text, holders or candidates)
            if holders:
                decision = dataclasses.replace(decision, reason="adapter")
        self._remember_adapter(decision.worker, adapter)
        if use_session:
            self._sessions[session_id] = decision.worker
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > s.max_sessions:
                self._sessions.popitem(last=False)
        self._load[decision.worker] = self._load.get(decision.worker, 0) + 1
        self._reasons[decision.reason] += 1
        self._picks[decision.worker] += 1
        return decision

    def _adapter_holders(self, adapter: str, candidates: list[str]) -> list[str] | None:
        """The candidates ``adapter`` was recently sent to, unless they are clearly busier
        than the least loaded candidate (the cache_aware imbalance thresholds); else None."""
        holders = [w for w in candidates if adapter in self._adapters.get(w, ())]
        if not holders:
            return None
        s = self._settings
        low_all = min(self._load[w] for w in candidates)
        low_held = min(self._load[w] for w in holders)
        if (low_held - low_all > s.balance_abs_threshold
                and low_held > s.balance_rel_threshold * low_all):
            return None
        return holders

    def _remember_adapter(self, worker: str, adapter: str | None) -> None:
        if adapter is None:
            return
        held = self._adapters.setdefault(worker, OrderedDict())
        held[adapter] = self._clock()
        held.move_to_end(adapter)
        while len(held) > self._settings.adapter_slots:
            held.popitem(last=False)

    def set_adapters_held(self, held: dict[str, list[str]], age_s: float = 0.0) -> None:
        """Each worker's own account of the LoRA adapters it holds (``held``: worker ->
        adapters, least recently used first), read at most ``age_s`` seconds ago. It replaces
        what this router believed of that worker (a slot reused for another adapter, an
        adapter unloaded, a worker restarted, a router restarted with no memory), except the
        adapters sent to it since the reading, which it may not have loaded yet. Unknown
        workers are ignored."""
        since = self._clock() - age_s - ADAPTER_REPORT_MARGIN_S
        for worker, names in held.items():
            if worker not in self._workers:
                continue
            before = self._adapters.get(worker, OrderedDict())
            now: OrderedDict[str, float | None] = OrderedDict((n, None) for n in names)
            for name, sent in before.items():
                if sent is not None and sent >= since:
                    now[name] = sent
                    now.move_to_end(name)
            self._adapters[worker] = now

    def _candidates(self, exclude: Collection[str]) -> list[str]:
        if not self._workers:
            raise NoWorkerAvailable("no workers registered (none is ready and routable)")
        excluded = set(exclude)
        remaining = [w for w in self._workers if w not in excluded]
        if not remaining:
            raise NoWorkerAvailable(f"all {len(self._workers)} workers are excluded")
        allowed = [w for w in remaining if self._breaker.allows(w)]
        if not allowed:
            raise NoWorkerAvailable(
                f"all circuits open: {len(remaining)} worker(s) not excluded, each has an "
                f"open circuit breaker ({len(self._workers) - len(remaining)} excluded)"
            )
        return allowed

    def _by_policy(self, text: str, candidates: list[str]) -> Decision:
        policy = self._settings.policy
        if policy == "cache_aware":
            return self._cache_aware(text, candidates)
        if policy == "round_robin":
            later = [w for w in candidates if self._rr_last is None or w > self._rr_last]
            worker = later[0] if later else candidates[0]
            self._rr_last = worker
            return Decision(worker, "round_robin")
        if policy == "least_load":
            return Decision(self._least_loaded(candidates, self._load), "least_load")
        if policy == "power_of_two":
            if len(candidates) == 1:
                return Decision(candidates[0], "power_of_two")
            first, second = self._rng.sample(candidates, 2)
            worker = second if self._load[second] < self._load[first] else first
            return Decision(worker, "power_of_two")
        return Decision(self._rng.choice(candidates), "random")

    def _cache_aware(self, text: str, candidates: list[str]) -> Decision:
        s = self._settings
        loads = {w: self._load[w] for w in candidates}
        max_load, min_load = max(loads.values()), min(loads.values())
        matches = self._tree.match(text)
        best = max((matches.get(w, 0) for w in candidates), default=0)
        rate = best / len(text) if text else 0.0
        if max_load - min_load > s.balance_abs_threshold and (
            max_load > s.balance_rel_threshold * min_load
        ):
            worker, reason = self._least_loaded(candidates, loads), "imbalance"
        elif rate > s.cache_threshold:
            longest = [w for w in candidates if matches.get(w, 0) == best]
            worker, reason = self._least_loaded(longest, loads), "cache_match"
        else:
            worker, reason = self._least_loaded(candidates, loads), "low_match"
        self._tree.insert(text, worker, self._clock())
        return Decision(worker, reason, rate)

    def _least_loaded(self, workers: list[str], loads: dict[str, int]) -> str:
        low = min(loads[w] for w in workers)
        return self._rng.choice([w for w in workers if loads[w] == low])

    # ------------------------------------------------------------ feedback

    def release(self, worker: str, ok: bool | None) -> None:
        """A request picked earlier ended: load -1 (never below 0).

        ``ok`` True records a circuit success, False a failure, None neither (the client
        went away, which says nothing about the worker). Outcomes of workers no longer
        routable are not recorded.
        """
        left = max(self._load.get(worker, 0) - 1, 0)
        if left or worker in self._workers:
            self._load[worker] = left
        else:
            self._load.pop(worker, None)
        if worker not in self._workers or ok is None:
            return
        if ok:
            self._breaker.record_success(worker)
        else:
            self._breaker.record_failure(worker)

    def set_policy(self, policy: str) -> None:
        """Switch policy (ValueError naming ``policy`` if unknown).

        A real switch clears the tree, the session map and the round-robin cursor; setting
        the current policy again changes nothing. Loads and circuits are kept.
        """
        _check_policy(policy)
        if policy == self._settings.policy:
            return
        self._settings = dataclasses.replace(self._settings, policy=policy)
        self._tree = PrefixTree()
        self._sessions.clear()
        self._rr_last = None

    def set_weight_versions(self, versions: dict[str, int | str]) -> list[str]:
        """Record each worker's weight version. A worker whose version changed loses its tree
        entries: the prefixes it cached under older weights are never reused (its radix cache
        retires them), so routing there for them would buy nothing. Returns those workers."""
        changed = [w for w, v in versions.items() if self._versions.get(w, v) != v]
        for worker in changed:
            self._tree.remove_worker(worker)
        self._versions.update(versions)
        return changed

    def forget_prefixes(self) -> None:
        """Empty the prefix tree (the workers' caches were flushed; sessions stay)."""
        self._tree = PrefixTree()

    def maybe_evict(self) -> int:
        """Evict the tree to max_tree_size per worker if eviction_interval_s has passed
        since the last eviction (or since construction); returns chars removed."""
        now = self._clock()
        if now - self._last_evict < self._settings.eviction_interval_s:
            return 0
        self._last_evict = now
        return self._tree.evict(self._settings.max_tree_size)

    # ------------------------------------------------------------ introspection

    def load(self, worker: str) -> int:
        """In-flight requests this router sent to ``worker``."""
        return self._load.get(worker, 0)

    def state(self) -> dict:
        """A JSON-serializable snapshot for /debug endpoints and metrics."""
        sizes = self._tree.worker_sizes()
        return {
            "policy": self._settings.policy,
            "settings": dataclasses.asdict(self._settings),
            "workers": {
                w: {
                    "load": self._load.get(w, 0),
                    "circuit": self._breaker.state(w),
                    "consecutive_failures": self._breaker.consecutive_failures(w),
                    "tree_chars": sizes.get(w, 0),
                    "picks": self._picks.get(w, 0),
                    "weight_version": self._versions.get(w),
                    "adapters": list(self._adapters.get(w, ())),
                }
                for w in self._workers
            },
            "inflight_departed": {
                w: n for w, n in self._load.items() if n and w not in self._workers
            },
            "tree": {"chars": self._tree.total_chars(), "nodes": self._tree.num_nodes()},
            "sessions": len(self._sessions),
            "decisions": dict(self._reasons),
            "picks": dict(self._picks),
            "open_circuits": [w for w in self._breaker.open_workers() if w in self._workers],
        }
