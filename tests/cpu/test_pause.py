"""pause_generation's three modes and continue_generation, in-process (tiny Llama)."""

import pytest
from engine_helpers import GREEDY, in_thread, wait_until

from radixray import Engine


@pytest.fixture
def fresh(tiny_llama_dir):
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096,
                check_kv_conservation=True) as engine:
        yield engine


def _decoding(s) -> bool:
    return any(r.output_ids for r in s.queues.running)


def _state(s) -> tuple:
    return (len(s.queues.running), len(s.queues.waiting), [len(r.output_ids) for r in s.queues.running + s.queues.waiting])


def _no_step_between_two_calls(engine: Engine) -> tuple:
    """Two control calls in a row: with work and not paused, the loop steps between them,
    so an unchanged state means no step ran."""
    first = engine.call_in_loop(_state)
    assert engine.call_in_loop(_state) == first
    return first


PARAMS = {"max_new_tokens": 40, **GREEDY}


def test_abort_ends_every_request_and_holds_new_ones_until_continue(fresh):
    t, box = in_thread(fresh.generate, prompt=["one long", "two long"], sampling_params={
        "max_new_tokens": 2000, **GREEDY})
    wait_until(fresh, _decoding)
    assert fresh.pause_generation("abort") == 2
    t.join(60)
    for out in box["out"]:
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "pause_generation" in reason["message"]
    later, got = in_thread(fresh.generate, prompt="after the pause", sampling_params=PARAMS)
    wait_until(fresh, lambda s: len(s.queues.waiting) == 1)
    assert _no_step_between_two_calls(fresh) == (0, 1, [0])  # queued, not scheduled
    assert fresh.continue_generation() is True
    later.join(60)
    assert len(got["out"]["output_ids"]) == 40
    assert fresh.continue_generation() is False


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_paused_requests_go_on_after_continue_with_an_unchanged_output(fresh, mode):
    """retract frees the request's KV and it prefills again; in_place keeps its KV and its
    place. Either way no step runs while paused and the greedy output is an unpaused run's."""
    want = fresh.generate("pause me", PARAMS)["output_ids"]
    t, box = in_thread(fresh.generate, prompt="pause me", sampling_params=PARAMS)
    wait_until(fresh, _decoding)
    assert fresh.pause_generation(mode) == 1
    running, waiting, lengths = _no_step_between_two_calls(fresh)
    if mode == "retract":
        assert (running, waiting) == (0, 1)
        kv = fresh.check_kv_conservation()  # nothing held by requests: free + cached == pool
        assert kv["free"] + kv["cached"] == kv["pool"]
    else:
        assert (running, waiting) == (1, 0) and 0 < lengths[0] < 40
        assert fresh.call_in_loop(lambda s: s.queues.running[0].kv_len) > 0  # its KV stays
    fresh.continue_generation()
    t.join(60)
    assert box["out"]["output_ids"] == want
    assert box["out"]["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)


def test_a_bad_mode_is_refused_and_changes_nothing(fresh):
    with pytest.raises(ValueError, match="mode must be one of .*'abort', 'retract', 'in_place'"):
        fresh.pause_generation("sideways")
    assert len(fresh.generate("still going", PARAMS)["output_ids"]) == 40
