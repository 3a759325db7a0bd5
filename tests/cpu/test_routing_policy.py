"""Router: cache_aware (sgl-model-gateway rules), baselines, affinity, circuits, state."""

from __future__ import annotations

import json
import random

import pytest

from radixray.cluster.circuit import CircuitBreaker
from radixray.cluster.routing import (
    POLICIES,
    Decision,
    NoWorkerAvailable,
    Router,
    RouterSettings,
)

# 100 distinct chars, so a request sharing k of them with a primed text matches exactly k.
PROMPT = "".join(chr(0x4E00 + i) for i in range(100))


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_router(workers=("a", "b"), seed=0, **settings) -> tuple[Router, FakeClock]:
    clock = FakeClock()
    router = Router(RouterSettings(**settings), clock=clock, rng=random.Random(seed))
    router.set_workers(list(workers))
    return router, clock


def set_load(router: Router, worker: str, n: int) -> None:
    """Put ``n`` in-flight requests on ``worker`` (empty text leaves the tree alone)."""
    others = [w for w in router.workers if w != worker]
    for _ in range(n):
        assert router.pick("", exclude=others).worker == worker


def prime(router: Router, text: str, worker: str) -> None:
    """Make the tree say ``worker`` holds ``text``, leaving its load unchanged."""
    others = [w for w in router.workers if w != worker]
    assert router.pick(text, exclude=others).worker == worker
    router.release(worker, ok=None)


# ------------------------------------------------------------------ cache_aware


@pytest.mark.parametrize(
    "load_a, load_b, imbalanced",
    [
        (40, 0, False),     # rel only: 40 > 1.5*0 but 40-0 <= 64
        (300, 210, False),  # abs only: 90 > 64 but 300 <= 315
        (100, 10, True),    # both
        (64, 0, False),     # abs exactly 64 is not > 64
        (65, 0, True),
        (300, 200, False),  # rel exactly 1.5x is not > 1.5x
        (301, 200, True),
    ],
)
def test_imbalance_needs_both_thresholds_strictly(load_a, load_b, imbalanced):
    router, _ = make_router()
    prime(router, PROMPT, "a")
    set_load(router, "a", load_a)
    set_load(router, "b", load_b)
    d = router.pick(PROMPT)
    if imbalanced:
        assert (d.worker, d.reason) == ("b", "imbalance")
    else:
        assert (d.worker, d.reason) == ("a", "cache_match")
    assert d.match_rate == 1.0


@pytest.mark.parametrize("matched, reason", [(31, "cache_match"), (30, "low_match"),
                                             (29, "low_match"), (0, "low_match")])
def test_match_rate_threshold_is_strict(matched, reason):
    router, _ = make_router()
    prime(router, PROMPT, "a")
    set_load(router, "a", 1)  # so the least-loaded choice is b
    request = PROMPT[:matched] + "z" * (100 - matched)
    d = router.pick(request)
    assert d == Decision("a" if reason == "cache_match" else "b", reason, matched / 100)


def test_empty_text_goes_to_least_loaded():
    router, _ = make_router()
    set_load(router, "a", 1)
    assert router.pick("") == Decision("b", "low_match", 0.0)


def test_longest_match_wins_over_load():
    router, _ = make_router(workers=("a", "b", "c"))
    prime(router, PROMPT[:50], "a")
    prime(router, PROMPT[:80], "b")
    set_load(router, "b", 5)
    d = router.pick(PROMPT)
    assert (d.worker, d.reason, d.match_rate) == ("b", "cache_match", 0.8)


def test_longest_match_tie_goes_to_lower_load():
    for seed in range(10):
        router, _ = make_router(workers=("a", "b", "c"), seed=seed)
        prime(router, PROMPT, "a")
        prime(router, PROMPT, "b")
        set_load(router, "a", 2)
        set_load(router, "b", 1)
        assert router.pick(PROMPT).worker == "b"  # c is least loaded but has no match


def test_least_loaded_tie_is_random_across_seeds():
    chosen = set()
    for seed in range(20):
        router, _ = make_router(workers=("a", "b", "c"), seed=seed)
        set_load(router, "c", 1)
        d = router.pick("fresh text")
        assert d.reason == "low_match" and d.worker in ("a", "b")
        chosen.add(d.worker)
    assert chosen == {"a", "b"}


def test_every_decision_inserts_text_under_chosen_worker():
    router, _ = make_router()
    d1 = router.pick("first request")  # low_match
    assert router.tree.match("first request") == {d1.worker: 13}
    prime(router, PROMPT, "a")
    set_load(router, "a", 100)
    d2 = router.pick(PROMPT)
    assert (d2.worker, d2.reason) == ("b", "imbalance")
    assert router.tree.match(PROMPT) == {"a": 100, "b": 100}
    d3 = router.pick(PROMPT, session_id="s")  # maps session "s"
    d4 = router.pick(PROMPT + "more", session_id="s")
    assert d4.reason == "affinity"
    assert router.tree.match(PROMPT + "more")[d3.worker] == 104


def test_exclude_and_match_only_over_candidates():
    router, _ = make_router(workers=("a", "b", "c"))
    prime(router, PROMPT, "a")
    prime(router, PROMPT[:40], "b")
    d = router.pick(PROMPT, exclude={"a"})
    assert (d.worker, d.reason, d.match_rate) == ("b", "cache_match", 0.4)
    d = router.pick(PROMPT, exclude=["a", "b"])
    assert (d.worker, d.reason, d.match_rate) == ("c", "low_match", 0.0)


# ------------------------------------------------------------------ affinity


def test_affinity_sticks_then_moves_when_worker_unavailable():
    router, clock = make_router(workers=("a", "b", "c"), policy="round_robin")
    assert router.pick("x", session_id="s") == Decision("a", "round_robin")
    for _ in range(3):
        assert router.pick("x", session_id="s") == Decision("a", "affinity")
    # Excluded: re-picked by the policy and remapped.
    moved = router.pick("x", session_id="s", exclude=["a"])
    assert moved.reason == "round_robin" and moved.worker != "a"
    assert router.pick("x", session_id="s") == Decision(moved.worker, "affinity")
    # Circuit opens.
    for _ in range(5):
        router.release(moved.worker, ok=False)
    after_open = router.pick("x", session_id="s")
    assert after_open.reason == "round_robin" and after_open.worker != moved.worker
    # Worker leaves.
    router.set_workers([w for w in ("a", "b", "c") if w != after_open.worker])
    last = router.pick("x", session_id="s")
    assert last.reason == "round_robin" and last.worker != after_open.worker


def test_affinity_disabled_and_session_lru_bound():
    router, _ = make_router(workers=("a", "b", "c"), policy="round_robin",
                            session_affinity=False)
    assert [router.pick("x", session_id="s").worker for _ in range(3)] == ["a", "b", "c"]
    router, _ = make_router(workers=("a", "b", "c"), policy="round_robin", max_sessions=2)
    router.pick("x", session_id="s1")
    router.pick("x", session_id="s2")
    assert router.pick("x", session_id="s1").reason == "affinity"  # s1 now most recent
    router.pick("x", session_id="s3")  # evicts s2, the least recently used
    assert router.state()["sessions"] == 2
    assert router.pick("x", session_id="s1").reason == "affinity"
    assert router.pick("x", session_id="s2").reason == "round_robin"


# ------------------------------------------------------------------ other policies


def test_round_robin_order_and_skipping():
    router, _ = make_router(workers=("c", "a", "b"), policy="round_robin")
    assert [router.pick("x").worker for _ in range(4)] == ["a", "b", "c", "a"]
    assert router.pick("x", exclude=["b"]).worker == "c"  # skips b
    for _ in range(5):
        router.release("b", ok=False)
    assert [router.pick("x").worker for _ in range(3)] == ["a", "c", "a"]  # b's circuit open
    assert router.tree.total_chars() == 0


def test_power_of_two_prefers_lower_load_of_two_samples():
    router, _ = make_router(workers=("a", "b"), policy="power_of_two")
    set_load(router, "a", 5)
    for _ in range(10):
        d = router.pick("x")
        assert d == Decision("b", "power_of_two")
        router.release("b", ok=True)
    # Ties go to the first sampled worker: replay the same rng.
    for seed in range(5):
        router, _ = make_router(workers=("a", "b", "c"), seed=seed, policy="power_of_two")
        ref = random.Random(seed)
        for _ in range(6):
            first, _second = ref.sample(["a", "b", "c"], 2)
            assert router.pick("x").worker == first
            router.release(first, ok=None)
    router, _ = make_router(workers=("a", "b"), policy="power_of_two")
    set_load(router, "b", 3)
    assert router.pick("x", exclude=["a"]).worker == "b"  # one candidate: no sampling
    assert router.tree.total_chars() == 0


def test_random_policy_follows_rng():
    router, _ = make_router(workers=("b", "a", "c"), seed=3, policy="random")
    ref = random.Random(3)
    picks = [router.pick("x").worker for _ in range(30)]
    assert picks == [ref.choice(["a", "b", "c"]) for _ in range(30)]
    assert set(picks) == {"a", "b", "c"}
    assert router.tree.total_chars() == 0


# ------------------------------------------------------------------ circuits


def test_circuit_breaker_states():
    clock = FakeClock()
    cb = CircuitBreaker(failure_threshold=5, cooldown_s=30.0, clock=clock)
    for _ in range(4):
        cb.record_failure("w")
    cb.record_success("w")  # a success resets the count
    assert cb.consecutive_failures("w") == 0
    for _ in range(4):
        cb.record_failure("w")
    assert cb.state("w") == "closed" and cb.allows("w")
    cb.record_failure("w")
    assert cb.state("w") == "open" and not cb.allows("w") and cb.open_workers() == ["w"]
    clock.t = 29.9
    assert not cb.allows("w")
    clock.t = 30.0
    assert cb.state("w") == "half_open" and cb.allows("w") and cb.open_workers() == []
    cb.record_failure("w")  # half-open failure reopens with a fresh cooldown
    assert cb.state("w") == "open"
    clock.t = 59.9
    assert not cb.allows("w")
    clock.t = 60.0
    assert cb.state("w") == "half_open"
    cb.record_success("w")
    assert cb.state("w") == "closed" and cb.consecutive_failures("w") == 0
    cb.record_failure("w")
    cb.forget("w")
    assert cb.consecutive_failures("w") == 0


def test_router_skips_open_circuit_for_cooldown():
    router, clock = make_router()
    prime(router, PROMPT, "a")
    for _ in range(5):
        router.pick("", exclude=["b"])
        router.release("a", ok=False)
    assert router.state()["open_circuits"] == ["a"]
    for _ in range(3):
        assert router.pick(PROMPT).worker == "b"  # a has the cache but its circuit is open
    clock.t = 30.0
    assert router.pick(PROMPT, exclude=["b"]).worker == "a"  # half-open lets it through
    router.release("a", ok=False)
    assert router.state()["workers"]["a"]["circuit"] == "open"
    clock.t = 60.0
    router.release("a", ok=True)
    assert router.state()["workers"]["a"]["circuit"] == "closed"
    router.release("a", ok=None)  # client went away: no circuit outcome
    assert router.state()["workers"]["a"]["consecutive_failures"] == 0


# ------------------------------------------------------------------ bookkeeping


def test_release_never_below_zero():
    router, _ = make_router()
    router.release("a", ok=None)
    assert router.load("a") == 0
    set_load(router, "a", 1)
    router.release("a", ok=True)
    router.release("a", ok=True)
    assert router.load("a") == 0 and router.load("nobody") == 0


def test_set_workers_removal_clears_tree_and_sessions_keeps_inflight():
    router, _ = make_router(workers=("a", "b"))
    prime(router, PROMPT, "a")
    set_load(router, "a", 2)
    router.pick("x", session_id="s", exclude=["b"])
    router.set_workers(["b", "c"])
    assert router.tree.match(PROMPT) == {}
    assert router.tree.worker_size("a") == 0
    assert router.state()["sessions"] == 0
    assert router.load("a") == 3  # in flight when it left
    for _ in range(5):
        assert router.pick(PROMPT, session_id="s").worker in ("b", "c")
    for _ in range(3):
        router.release("a", ok=False)
    assert router.load("a") == 0
    assert router.state()["workers"].keys() == {"b", "c"}
    assert "a" not in router.state()["inflight_departed"]


def test_set_policy_validates_and_clears():
    with pytest.raises(ValueError, match="policy") as err:
        RouterSettings(policy="least_loaded")
    assert all(p in str(err.value) for p in POLICIES)
    with pytest.raises(ValueError, match="cache_threshold"):
        RouterSettings(cache_threshold=-0.1)
    with pytest.raises(ValueError, match="balance_abs_threshold"):
        RouterSettings(balance_abs_threshold=-1)
    with pytest.raises(ValueError, match="max_sessions"):
        RouterSettings(max_sessions=0)
    router, _ = make_router(workers=("a", "b", "c"))
    router.pick(PROMPT, session_id="s")
    with pytest.raises(ValueError, match="policy"):
        router.set_policy("nope")
    router.set_policy("cache_aware")  # same policy: nothing cleared
    assert router.tree.total_chars() == 100 and router.state()["sessions"] == 1
    router.set_policy("round_robin")
    assert router.tree.total_chars() == 0 and router.state()["sessions"] == 0
    assert [router.pick("x").worker for _ in range(2)] == ["a", "b"]
    router.set_policy("random")
    router.set_policy("round_robin")  # cursor reset: starts over
    assert router.pick("x").worker == "a"
    assert router.state()["policy"] == "round_robin"


def test_maybe_evict_runs_once_per_interval():
    router, clock = make_router(max_tree_size=10, eviction_interval_s=120.0)
    prime(router, PROMPT, "a")
    clock.t = 119.0
    assert router.maybe_evict() == 0
    assert router.tree.worker_size("a") == 100
    clock.t = 120.0
    assert router.maybe_evict() == 100  # one 100-char leaf: all of it goes
    assert router.tree.worker_size("a") == 0
    prime(router, PROMPT, "a")
    clock.t = 200.0
    assert router.maybe_evict() == 0  # only 80 s since the last run
    clock.t = 240.0
    assert router.maybe_evict() == 100


def test_no_worker_available_messages():
    router, _ = make_router(workers=())
    with pytest.raises(NoWorkerAvailable, match="no workers"):
        router.pick("x")
    router.set_workers(["a", "b"])
    with pytest.raises(NoWorkerAvailable, match="excluded"):
        router.pick("x", exclude=["a", "b"])
    for _ in range(5):
        router.release("a", ok=False)
    with pytest.raises(NoWorkerAvailable, match="all circuits open"):
        router.pick("x", exclude=["b"])


def test_state_is_json_and_counts_decisions():
    router, _ = make_router(workers=("a", "b"))
    prime(router, PROMPT, "a")
    router.pick(PROMPT)
    router.pick(PROMPT, session_id="s")
    router.pick(PROMPT, session_id="s")
    state = json.loads(json.dumps(router.state()))
    assert state["policy"] == "cache_aware"
    assert state["settings"]["cache_threshold"] == 0.3
    assert state["decisions"] == {"low_match": 1, "cache_match": 2, "affinity": 1}
    assert state["picks"] == {"a": 4}
    assert state["workers"]["a"]["load"] == 3 and state["workers"]["b"]["load"] == 0
    assert state["workers"]["a"]["tree_chars"] == 100
    assert state["tree"] == {"chars": 100, "nodes": 1}
    assert state["sessions"] == 1 and state["open_circuits"] == []


def test_forget_prefixes_empties_the_tree_but_keeps_sessions():
    router, _ = make_router()
    router.pick("the same long system prompt and question", session_id="s")
    assert router.tree.total_chars() > 0
    router.forget_prefixes()
    assert router.tree.total_chars() == 0 and router.state()["sessions"] == 1
    d = router.pick("the same long system prompt and question")
    assert d.reason == "low_match"  # nothing to match any more


def test_a_worker_with_new_weights_loses_its_prefixes_and_others_keep_theirs():
    router, _ = make_router()
    router.set_weight_versions({"a": 0, "b": 0})
    router.tree.insert(PROMPT, "a", 0.0)
    router.tree.insert(PROMPT[:50], "b", 0.0)
    assert router.set_weight_versions({"a": 0, "b": 0}) == []
    assert router.tree.match(PROMPT) == {"a": 100, "b": 50}
    assert router.set_weight_versions({"a": 3}) == ["a"]
    assert router.tree.match(PROMPT) == {"b": 50}
    assert router.state()["workers"]["a"]["weight_version"] == 3
    decision = router.pick(PROMPT)
    assert decision.worker == "b" and decision.reason == "cache_match"


def test_an_adapters_requests_go_to_the_worker_that_ran_it_before_prefix_affinity():
    from radixray.cluster.routing import adapter_of, adapter_route_text
    router, _ = make_router(("a", "b", "c"), seed=3)
    key = adapter_route_text(PROMPT, "alpha")
    assert adapter_of(key) == "alpha" and adapter_of(PROMPT) is None
    first = router.pick(key)
    router.release(first.worker, True)
    # distinct texts (no prefix to follow): every later one goes where alpha ran
    for i in range(5):
        d = router.pick(adapter_route_text(chr(0x6000 + i) * 30, "alpha"))
        assert (d.worker, d.reason) == (first.worker, "adapter")
        router.release(d.worker, True)
    # a base request with alpha's prompt shares no cache with it: nothing to match
    assert router.pick(PROMPT).match_rate == 0.0
    assert "alpha" in router.state()["workers"][first.worker]["adapters"]
    # holders clearly busier than the rest: load balance wins
    set_load(router, first.worker, 200)
    assert router.pick(adapter_route_text("zz", "alpha")).worker != first.worker


def test_the_router_remembers_adapter_slots_per_worker_least_recent_out():
    from radixray.cluster.routing import adapter_route_text
    router, _ = make_router(("a",), adapter_slots=2)
    for name in ("x", "y", "z"):
        router.release(router.pick(adapter_route_text("t", name)).worker, True)
    assert router.state()["workers"]["a"]["adapters"] == ["y", "z"]


def test_the_workers_reports_of_the_adapters_they_hold_replace_the_routers_guess():
    from radixray.cluster.routing import adapter_route_text
    router, clock = make_router(("a", "b", "c"))
    sent = router.pick(adapter_route_text("t", "alpha"))  # the router's own guess
    router.release(sent.worker, True)
    other = next(w for w in ("a", "b", "c") if w != sent.worker)
    clock.t += 5.0
    # the worker it was sent to no longer holds alpha (its slot went to another adapter);
    # another worker does (a router restarted with no memory learns it the same way)
    router.set_adapters_held({sent.worker: ["beta"], other: ["gamma", "alpha"], "gone": ["x"]},
                             age_s=0.5)
    assert router.state()["workers"][sent.worker]["adapters"] == ["beta"]
    assert router.state()["workers"][other]["adapters"] == ["gamma", "alpha"]
    for i in range(3):
        d = router.pick(adapter_route_text(chr(0x6000 + i) * 30, "alpha"))
        assert (d.worker, d.reason) == (other, "adapter")
        router.release(d.worker, True)
    # an adapter sent after the reading survives the report (the worker may not have it yet)
    d = router.pick(adapter_route_text("u", "delta"))
    router.release(d.worker, True)
    router.set_adapters_held({d.worker: []}, age_s=0.5)
    assert router.state()["workers"][d.worker]["adapters"] == ["delta"]
    clock.t += 5.0  # a later reading without it: the worker does not hold it
    router.set_adapters_held({d.worker: []}, age_s=0.5)
    assert router.state()["workers"][d.worker]["adapters"] == []
