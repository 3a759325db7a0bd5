"""Admission control: the token budget, the new-token-ratio forecast and the waiting-queue order.

The end-to-end test replays the reference's worked example: a 4,096-token pool,
16 requests of 256 prompt tokens + 512 ignore_eos output tokens. Each reserves
768 tokens, so exactly five run at once while eleven wait, in waves of five.
"""

from __future__ import annotations

import itertools
import random

import pytest

from radixray import Engine
from radixray.engine.request import Req
from radixray.engine.sampling import SamplingParams
from radixray.engine.sched.admission import (
    CLIP_MAX_NEW_TOKENS,
    NewTokenRatio,
    PrefillBudget,
    new_request_need,
    reserved_for_running,
    retraction_order,
)
from radixray.engine.sched.policy import LPM_MAX_QUEUE, active_policy, order_waiting

_rids = itertools.count()


def make_req(prompt_len: int = 4, max_new_tokens: int = 16, outputs: int = 0,
             ignore_eos: bool = False, priority: int = 0, arrival: float | None = None) -> Req:
    req = Req(rid=f"r{next(_rids)}", prompt_ids=[1] * prompt_len,
              sampling=SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos),
              priority=priority)
    req.output_ids = [2] * outputs
    if arrival is not None:
        req.arrival_time = arrival
    return req


# ---------------------------------------------------------------- NewTokenRatio
@pytest.mark.parametrize("conservativeness", [1.0, 0.5, 1.3])
def test_new_token_ratio_decays_linearly_to_its_floor(conservativeness):
    ratio = NewTokenRatio(conservativeness)
    init = min(1.0, 0.7 * conservativeness)
    assert ratio.value == pytest.approx(init)
    floor = 0.14 * init
    for _ in range(300):
        ratio.step()
    assert ratio.value == pytest.approx(init - (init - floor) / 2)  # linear: halfway at step 300
    for _ in range(300):
        ratio.step()
    assert ratio.value == pytest.approx(floor)  # reaches 0.14 x init after 600 steps
    for _ in range(1000):
        ratio.step()
    assert ratio.value == pytest.approx(floor)  # and stays there
    ratio.reset()
    assert ratio.value == pytest.approx(init)


def test_new_token_ratio_defaults_and_cap():
    assert NewTokenRatio().value == pytest.approx(0.7)
    assert NewTokenRatio().min == pytest.approx(0.098)
    assert NewTokenRatio(2.0).value == 1.0  # 0.7 x 2 is capped at 1


def test_new_token_ratio_reset_after_retraction():
    ratio = NewTokenRatio(1.0)
    for _ in range(600):
        ratio.step()
    survivors = [make_req(max_new_tokens=500, outputs=100), make_req(max_new_tokens=300, outputs=50)]
    ratio.reset_after_retraction(survivors)
    # (decoded so far + 20 per request) / total max_new_tokens
    assert ratio.value == pytest.approx((150 + 20 * 2) / 800)
    nearly_done = [make_req(max_new_tokens=30, outputs=25)]
    ratio.reset_after_retraction(nearly_done)
    assert ratio.value == 1.0  # capped
    ratio.reset_after_retraction([])
    assert ratio.value == pytest.approx(0.7)


# ---------------------------------------------------------------- token budget
def test_reserved_for_running_uses_ratio_one_for_ignore_eos():
    may_stop = make_req(max_new_tokens=512, outputs=12)
    never_stops = make_req(max_new_tokens=512, outputs=12, ignore_eos=True)
    assert reserved_for_running([may_stop], 0.25) == pytest.approx(500 * 0.25)
    assert reserved_for_running([never_stops], 0.25) == pytest.approx(500.0)
    assert reserved_for_running([may_stop, never_stops], 0.5) == pytest.approx(250 + 500)
    huge = make_req(max_new_tokens=100_000)
    assert reserved_for_running([huge], 0.5) == pytest.approx(CLIP_MAX_NEW_TOKENS * 0.5)
    done = make_req(max_new_tokens=10, outputs=10)
    assert reserved_for_running([done], 1.0) == 0


def test_new_request_needs_prompt_plus_clipped_max_new_tokens():
    assert new_request_need(256, make_req(max_new_tokens=512)) == 768
    assert new_request_need(10, make_req(max_new_tokens=100_000)) == 10 + CLIP_MAX_NEW_TOKENS


def test_worked_example_budget_admits_exactly_five():
    """Pure arithmetic of the worked example: 5 x 768 = 3,840 fits in 4,096; a sixth would not."""
    budget = PrefillBudget.start(4096, [], 0.7, max_prefill_tokens=16384, chunked_prefill_size=None)
    reqs = [make_req(prompt_len=256, max_new_tokens=512, ignore_eos=True) for _ in range(16)]
    results = [budget.try_add(r, 256) for r in reqs]
    assert results[:5] == ["added"] * 5
    assert results[5] == "no_token"
    assert budget.rem_total_tokens == 4096 - 5 * 768


def test_retraction_order_fewest_outputs_then_longest_prompt():
    a = make_req(prompt_len=10, outputs=5)
    b = make_req(prompt_len=50, outputs=5)
    c = make_req(prompt_len=99, outputs=40)
    d = make_req(prompt_len=5, outputs=1)
    assert retraction_order([a, b, c, d]) == [d, b, a, c]


# ---------------------------------------------------------------- queue order
def test_fcfs_keeps_arrival_order():
    reqs = [make_req(arrival=t) for t in (3.0, 1.0, 2.0)]
    out = order_waiting(reqs, "fcfs", cache_disabled=False, prefix_len=lambda r: 0,
                        priority_first=False)
    assert [r.arrival_time for r in out] == [1.0, 2.0, 3.0]


def test_lpm_puts_longest_prefix_first_then_arrival():
    reqs = [make_req(arrival=float(t)) for t in range(4)]
    prefix = {reqs[0].rid: 0, reqs[1].rid: 7, reqs[2].rid: 3, reqs[3].rid: 7}
    out = order_waiting(reqs, "lpm", cache_disabled=False, prefix_len=lambda r: prefix[r.rid],
                        priority_first=False)
    assert out == [reqs[1], reqs[3], reqs[2], reqs[0]]


def test_lpm_falls_back_to_fcfs_when_queue_long_or_cache_disabled():
    def run(n, cache_disabled):
        reqs = [make_req(arrival=float(t)) for t in range(n)]
        calls = []

        def prefix_len(r):  # later arrivals have longer prefixes
            calls.append(r)
            return int(r.arrival_time)
        out = order_waiting(reqs, "lpm", cache_disabled=cache_disabled, prefix_len=prefix_len,
                            priority_first=False)
        return out, reqs, calls

    out, reqs, calls = run(LPM_MAX_QUEUE, cache_disabled=False)
    assert LPM_MAX_QUEUE == 128
    assert out == reqs[::-1] and len(calls) == LPM_MAX_QUEUE  # lpm active at 128 waiting
    out, reqs, calls = run(LPM_MAX_QUEUE + 1, cache_disabled=False)
    assert out == reqs and not calls  # above 128: fcfs, no prefix matching at all
    out, reqs, calls = run(5, cache_disabled=True)
    assert out == reqs and not calls
    assert active_policy("lpm", 129, False) == "fcfs"
    assert active_policy("lpm", 10, True) == "fcfs"
    assert active_policy("lpm", 10, False) == "lpm"
    assert active_policy("fcfs", 10, False) == "fcfs"


def test_priority_first_then_policy_within_a_priority():
    reqs = [make_req(priority=p, arrival=float(t)) for t, p in enumerate([0, 5, 0, 5, 9])]
    out = order_waiting(reqs, "fcfs", cache_disabled=False, prefix_len=lambda r: 0,
                        priority_first=True)
    assert out == [reqs[4], reqs[1], reqs[3], reqs[0], reqs[2]]
    prefix = {reqs[1].rid: 1, reqs[3].rid: 8}
    out = order_waiting(reqs, "lpm", cache_disabled=False,
                        prefix_len=lambda r: prefix.get(r.rid, 0), priority_first=True)
    assert out == [reqs[4], reqs[3], reqs[1], reqs[0], reqs[2]]
    # Without priority scheduling the priority field is ignored.
    out = order_waiting(reqs, "fcfs", cache_disabled=False, prefix_len=lambda r: 0,
                        priority_first=False)
    assert out == reqs


# ---------------------------------------------------------------- engine level
def record_steps(engine: Engine) -> list[tuple[int, int]]:
    """(running, waiting) after every scheduler step, appended on the scheduler thread."""
    history: list[tuple[int, int]] = []
    engine.call_in_loop(lambda s: setattr(
        s, "on_step", lambda sched: history.append((len(sched.queues.running), len(sched.queues.waiting)))))
    return history


def settle(engine: Engine) -> None:
    """Wait until the step that finished the last request has been recorded too."""
    engine.call_in_loop(lambda s: None)


def compress(history: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [k for k, _ in itertools.groupby(history)]


def test_worked_example_five_run_eleven_wait_in_waves(tiny_llama_dir):
    rng = random.Random(1234)
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096,
                check_kv_conservation=True) as eng:
        vocab = eng.limits.vocab_size
        prompts = [[rng.randrange(1, vocab) for _ in range(256)] for _ in range(16)]
        history = record_steps(eng)
        outs = eng.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": 512, "ignore_eos": True, "temperature": 0.0})
        settle(eng)
        sched = eng.scheduler
        assert sched.max_running_seen == 5
        assert max(r for r, _ in history) == 5
        # Five start in one prefill batch, eleven wait; each wave of five finishes together
        # (same length, ignore_eos) before the next five start; the last one runs alone.
        assert compress(history) == [(5, 11), (0, 11), (5, 6), (0, 6), (5, 1), (0, 1), (1, 0),
                                     (0, 0)]
        assert history.count((5, 11)) == 511  # 1 prefill + 510 decode steps, all with 11 waiting
        # The forecast for ignore_eos requests is exact: nothing is ever retracted.
        assert sched.stats.num_retracted_reqs == 0
        assert all(len(o["output_ids"]) == 512 for o in outs)
        assert all(o["meta_info"]["num_retractions"] == 0 for o in outs)
        # The second wave was admitted after the first wave finished (all arrived in one
        # call, microseconds apart): a causal bound, not a speed ratio.
        by_wait = sorted(outs, key=lambda o: o["meta_info"]["queue_time"])
        first_done = min(o["meta_info"]["e2e_latency"] for o in by_wait[:5])
        assert by_wait[5]["meta_info"]["queue_time"] > 0.5 * first_done
        eng.check_kv_conservation()


def test_cached_prefix_is_not_counted_twice(tiny_llama_dir):
    """A matched prefix is locked on admission, so its evictable tokens cannot also pay for the
    request's new tokens. Counting them twice over-admits, and even exactly-forecast ignore_eos
    requests then run out of KV and get retracted."""
    rng = random.Random(7)
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=500,
                check_kv_conservation=True) as eng:
        vocab = eng.limits.vocab_size
        prefix = [rng.randrange(1, vocab) for _ in range(150)]
        eng.generate(input_ids=prefix, sampling_params={"max_new_tokens": 1})
        # Each needs 10 + 100 tokens beside the shared 150: three fit (480), four do not (590).
        prompts = [prefix + [rng.randrange(1, vocab) for _ in range(10)] for _ in range(4)]
        history = record_steps(eng)
        outs = eng.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": 100, "ignore_eos": True, "temperature": 0.0})
        settle(eng)
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [150] * 4
        assert max(r for r, _ in history) == 3
        assert eng.scheduler.stats.num_retracted_reqs == 0
        assert all(len(o["output_ids"]) == 100 for o in outs)
        eng.check_kv_conservation()


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_schedule_policy_in_the_engine(tiny_llama_dir, policy):
    """With one request at a time, lpm starts the request whose prefix is cached first."""
    rng = random.Random(11)
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=2048,
                max_running_requests=1, schedule_policy=policy, check_kv_conservation=True) as eng:
        vocab = eng.limits.vocab_size
        cached = [rng.randrange(1, vocab) for _ in range(40)]
        eng.generate(input_ids=cached, sampling_params={"max_new_tokens": 1})
        cold = [rng.randrange(1, vocab) for _ in range(40)]
        while cold[0] == cached[0]:
            cold[0] = rng.randrange(1, vocab)
        warm = cached[:30] + [rng.randrange(1, vocab) for _ in range(10)]
        outs = eng.generate(input_ids=[cold, warm], sampling_params={
            "max_new_tokens": 4, "ignore_eos": True})
        cold_wait, warm_wait = (o["meta_info"]["queue_time"] for o in outs)
        assert outs[1]["meta_info"]["cached_tokens"] == 30
        if policy == "lpm":
            assert warm_wait < cold_wait
        else:
            assert cold_wait < warm_wait
        eng.check_kv_conservation()
