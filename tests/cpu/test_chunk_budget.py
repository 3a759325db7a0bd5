"""The inter-token-latency budget of mixed prefill steps (engine/sched/chunk_budget.py), as
pure logic fed measured seconds by the test (no clock is read): the online cost model
recovers a known cost, keeps its coefficients non-negative and follows a change of load;
a step takes the largest prompt chunk whose predicted time fits the target, within
[32, chunked_prefill_size] and the growth limit; steps without riders, and engines where
timing must not decide (deterministic, expert parallel, prefill workers), take the fixed
chunk. The option's default and its flags."""

from __future__ import annotations

import argparse
import random

import pytest

from radixray.engine.config import EngineConfig
from radixray.engine.options import add_flags, from_flags
from radixray.engine.sched.admission import PrefillBudget
from radixray.engine.sched.chunk_budget import (
    GROWTH,
    MIN_PREFILL_TOKENS,
    START_PREFILL_TOKENS,
    ChunkBudget,
    ForwardCostModel,
    ForwardWork,
    attention_pairs,
)


def linear_cost(a: float, b: float, c: float = 0.0):
    """Seconds of a step: ``a`` + ``b`` per token + ``c`` per attention pair."""
    return lambda w: a + b * w.tokens + c * w.pairs


def feed(model: ForwardCostModel, cost, works) -> None:
    for w in works:
        model.observe(w, cost(w))


def varied_works(n: int, seed: int = 0) -> list[ForwardWork]:
    """Steps whose tokens and attention pairs vary independently (riders plus a chunk at
    some context)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        riders, chunk, context = rng.randrange(0, 64), rng.randrange(16, 600), rng.randrange(0, 4000)
        rider_pairs = sum(attention_pairs(rng.randrange(10, 3000), 1) for _ in range(riders))
        out.append(ForwardWork(riders + chunk, rider_pairs + attention_pairs(context, chunk)))
    return out


def test_fit_recovers_a_known_cost():
    cost = linear_cost(0.05, 0.002, 3e-8)
    model = ForwardCostModel()
    feed(model, cost, varied_works(40))
    a, b, c = model.coef
    assert a == pytest.approx(0.05, rel=1e-3)
    assert b == pytest.approx(0.002 * 1e3, rel=1e-3)  # per thousand tokens
    assert c == pytest.approx(3e-8 * 1e6, rel=1e-3)  # per million pairs
    for w in varied_works(10, seed=1):
        assert model.predict(w) == pytest.approx(cost(w), rel=1e-3)


def test_coefficients_stay_non_negative():
    """Samples that a plain least-squares fit explains with a negative intercept (a cost
    superlinear in tokens) get non-negative coefficients, and predictions rising with work."""
    model = ForwardCostModel()
    for tokens in (40, 80, 160, 320, 640):
        model.observe(ForwardWork(tokens, 0), 1e-6 * tokens ** 2)
    assert model.coef is not None and min(model.coef) >= 0
    preds = [model.predict(ForwardWork(t, 0)) for t in (50, 100, 200, 400)]
    assert preds == sorted(preds) and preds[0] > 0


def test_one_size_scales_its_mean_time_by_tokens():
    model = ForwardCostModel()
    assert model.predict(ForwardWork(100, 0)) is None
    for seconds in (0.30, 0.34, 0.32):
        model.observe(ForwardWork(100, 5000), seconds)
    assert model.coef is None  # one size: fixed and per-token cost cannot be told apart
    mean = model.predict(ForwardWork(100, 5000))
    assert 0.30 < mean < 0.34
    assert model.predict(ForwardWork(200, 5000)) == pytest.approx(2 * mean)


def test_fit_follows_a_change_of_load():
    """The host gets three times slower: within twenty steps the predictions are the new
    cost's (old samples' weight decays by 0.9 per step)."""
    model = ForwardCostModel()
    works = varied_works(60)
    feed(model, linear_cost(0.05, 0.002), works[:30])
    slow = linear_cost(0.15, 0.006)
    feed(model, slow, works[30:50])
    for w in works[50:]:
        assert model.predict(w) == pytest.approx(slow(w), rel=0.15)


def budget_with(cost, target_ms: float = 500, chunk: int = 2048, samples=None) -> ChunkBudget:
    budget = ChunkBudget(target_ms, chunk)
    feed(budget.cost, cost, samples if samples is not None else varied_works(30))
    return budget


@pytest.mark.parametrize("riders", [1, 8, 32, 60])
def test_step_takes_the_largest_chunk_that_fits(riders):
    cost = linear_cost(0.06, 0.0025, 5e-8)
    budget = budget_with(cost)
    rider_pairs = riders * 600
    step = budget.step_tokens(riders, rider_pairs, context=256)
    n = step.tokens
    assert step.sized and MIN_PREFILL_TOKENS < n < 2048

    def t(k):
        return cost(ForwardWork(riders + k, rider_pairs + attention_pairs(256, k)))

    assert t(n) <= 0.5 < t(n + 1)
    assert step.predicted_s == pytest.approx(t(n), rel=1e-3)
    # riders' cost counts in: more riders, fewer prompt tokens
    assert budget.step_tokens(riders + 10, rider_pairs + 6000, 256).tokens < n


def test_step_size_bounds():
    heavy = budget_with(linear_cost(0.6, 0.01))  # the riders alone exceed the target
    assert heavy.step_tokens(32, 20000).tokens == MIN_PREFILL_TOKENS
    # anything fits and a whole chunk was measured: the chunk bounds it
    light = budget_with(linear_cost(0.001, 1e-6), samples=varied_works(30) + [ForwardWork(2048, 0)])
    assert light.step_tokens(4, 2000).tokens == 2048
    small = budget_with(linear_cost(0.6, 0.01), chunk=16)  # a chunk below the minimum
    assert small.step_tokens(32, 20000).tokens == 16


def test_cold_start_then_growth_limited_by_measured_sizes():
    cost = linear_cost(0.001, 1e-6)  # cheap: only the growth limit holds a step back
    budget = ChunkBudget(500, 2048)
    first = budget.step_tokens(4, 400)
    assert first.tokens == START_PREFILL_TOKENS and first.sized and first.predicted_s is None
    sizes = []
    for _ in range(12):
        n = budget.step_tokens(4, 400).tokens
        sizes.append(n)
        budget.cost.observe(ForwardWork(4 + n, 400 + attention_pairs(0, n)),
                            cost(ForwardWork(4 + n, 0)))
    assert sizes[0] == START_PREFILL_TOKENS
    for prev, nxt in zip(sizes, sizes[1:]):
        assert nxt <= int(GROWTH * (prev + 4)) - 4
    assert sizes[-1] == 2048 and sizes == sorted(sizes)


def test_closed_loop_settles_at_the_target():
    """Each step is sized, run (its seconds from a fixed cost with 10% noise) and fed back:
    after a first step without riders (the whole chunk), the steps settle within the noise
    of the target, at the chunk the true cost allows."""
    rng = random.Random(3)
    cost = linear_cost(0.06, 0.0025)
    budget = ChunkBudget(500, 2048)
    assert budget.step_tokens(0, 0).tokens == 2048  # nothing running: the fixed chunk
    budget.cost.observe(ForwardWork(2048, attention_pairs(0, 2048)), cost(ForwardWork(2048, 0)))
    took = []
    for _ in range(40):
        n = budget.step_tokens(32, 32 * 600, 256).tokens
        w = ForwardWork(32 + n, 32 * 600 + attention_pairs(256, n))
        seconds = cost(w) * (1 + 0.1 * (rng.random() - 0.5))
        budget.cost.observe(w, seconds)
        took.append((n, seconds))
    best = int((0.5 - 0.06) / 0.0025) - 32  # 144
    for n, seconds in took[5:]:
        assert abs(n - best) <= 0.1 * best
        assert seconds <= 0.5 * 1.1


def test_fixed_chunk_without_riders_or_target():
    budget = budget_with(linear_cost(0.06, 0.0025))
    assert budget.step_tokens(0, 0).tokens == 2048 and not budget.last.sized
    off = ChunkBudget(None, 2048)
    assert not off.timed and off.step_tokens(32, 20000).tokens == 2048
    assert not ChunkBudget(0, 2048).timed
    assert not ChunkBudget(500, None).timed and ChunkBudget(500, None).step_tokens(4, 40).tokens is None
    off.observe(None, 1.0)  # the fixed chunk measures nothing (no batch needed)
    assert off.cost.samples == 0


def test_sized_chunk_keeps_riders_out_of_it():
    """A chunk sized by time has the riders' cost in it already: they take nothing more from
    it (the fixed chunk gives them up to half), only from the KV and input budgets."""
    budget = PrefillBudget(rem_total_tokens=1000, rem_input_tokens=500, rem_chunk_tokens=144)
    budget.reserve_riders(32, from_chunk=False)
    assert (budget.rem_total_tokens, budget.rem_input_tokens, budget.rem_chunk_tokens) == \
        (968, 468, 144)


def test_option_default_reasons_and_flags():
    config = EngineConfig()
    assert config.enable_mixed_chunk and config.max_itl_ms == 500
    assert config.itl_budget_ms == 500 and config.itl_budget_off_reason is None
    for changes, words in (({"max_itl_ms": 0}, "max_itl_ms"), ({"max_itl_ms": None}, "max_itl_ms"),
                           ({"enable_mixed_chunk": False}, "enable_mixed_chunk"),
                           ({"chunked_prefill_size": 0}, "chunked prefill"),
                           ({"deterministic": True}, "deterministic"),
                           ({"ep_size": 2}, "expert parallelism"),
                           ({"disaggregation_mode": "prefill"}, "prefill worker")):
        config = EngineConfig(**changes)
        assert config.itl_budget_ms is None and words in config.itl_budget_off_reason
    assert EngineConfig(disaggregation_mode="decode").itl_budget_ms == 500
    with pytest.raises(ValueError, match="max_itl_ms"):
        EngineConfig(max_itl_ms=-1)
    parser = argparse.ArgumentParser()
    add_flags(parser, EngineConfig, with_defaults=False)
    assert from_flags(parser.parse_args([]), EngineConfig) == {}
    got = from_flags(parser.parse_args(["--no-enable-mixed-chunk", "--max-itl-ms", "250"]),
                     EngineConfig)
    assert got == {"enable_mixed_chunk": False, "max_itl_ms": 250.0}
    assert from_flags(parser.parse_args(["--enable-mixed-chunk"]), EngineConfig) == \
        {"enable_mixed_chunk": True}
