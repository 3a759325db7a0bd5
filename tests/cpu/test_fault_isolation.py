"""One request must never stop the engine: legal extreme sampling values, a fault in one
batch, faults on every step, a scheduler thread that dies (in-process, tiny Llama)."""

import pytest
from engine_helpers import GREEDY, call_with_timeout, in_thread, wait_until

from radixray import Engine, EngineFailed
from radixray.engine.faults import FailForwards, FaultInjector

OPTS = dict(dtype="float32", max_total_tokens=4096, check_kv_conservation=True)


@pytest.fixture
def fresh(tiny_llama_dir):
    """An engine of its own: these tests break engines on purpose."""
    with Engine(model=tiny_llama_dir, max_consecutive_failed_steps=3, **OPTS) as engine:
        yield engine


def _reason(out: dict) -> dict:
    return out["meta_info"]["finish_reason"]


def decoding(s) -> bool:
    """wait_until predicate: some request has produced a token and decodes."""
    return any(r.output_ids for r in s.queues.running)


def _catch(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # returned for the assertion
        return exc


def _conserved(engine: Engine) -> dict:
    kv = engine.check_kv_conservation()  # raises unless free + held + cached == pool
    assert kv["running"] == 0 and kv["waiting"] == 0
    return kv


@pytest.mark.parametrize("params", [
    {"top_p": 5e-324}, {"repetition_penalty": 5e-324}, {"repetition_penalty": 1e308},
    {"temperature": 5e-324}, {"temperature": 1e308}, {"min_p": 1.0, "top_p": 1e-45},
    {"temperature": 1e-7, "return_logprob": True, "top_logprobs_num": 5},
    {"seed": 2**64 - 1, "temperature": 2.0},
])
def test_extreme_legal_values_return_tokens_and_the_engine_serves_on(eng, params):
    """The issue's two calls: an extreme value used to kill the scheduler thread, and the
    next greedy request then never returned."""
    out = call_with_timeout(eng.generate, prompt="hello",
                            sampling_params={**params, "max_new_tokens": 4, "ignore_eos": True})
    assert _reason(out)["type"] == "length" and len(out["output_ids"]) == 4
    for lp in out.get("output_token_logprobs", []):
        assert lp == lp and abs(lp) != float("inf")
    after = call_with_timeout(eng.generate, prompt="hello",
                              sampling_params={"temperature": 0, "max_new_tokens": 4})
    assert after["output_ids"] and after["meta_info"]["finish_reason"]["type"] in ("length", "stop")


@pytest.mark.parametrize("params, needle", [
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"top_p": float("nan")}, "top_p must be a number"),
    ({"repetition_penalty": 10**400}, "repetition_penalty must be a finite number"),
    ({"seed": 2**64}, "seed must be <= 18446744073709551615"),
])
def test_values_no_float_can_hold_are_rejected_naming_the_field(eng, params, needle):
    with pytest.raises(ValueError, match=needle):
        eng.generate("hello", params)


def test_one_faulty_forward_fails_only_its_batch(fresh):
    """A prefill batch of two fails; the requests after it are served; no KV slot is lost."""
    fresh.attach_fault_injector(FaultInjector(FailForwards(1, "boom in one forward")))
    outs = fresh.generate(["first prompt", "second one"], {"max_new_tokens": 3, **GREEDY})
    for out in outs:
        reason = _reason(out)
        assert reason["type"] == "error" and reason["status"] == 500
        assert "InjectedFault: boom in one forward" in reason["message"]
    _conserved(fresh)
    assert fresh.health().ok and fresh.health().failed_steps == 1
    again = fresh.generate(["first prompt", "second one"], {"max_new_tokens": 3, **GREEDY})
    assert [len(o["output_ids"]) for o in again] == [3, 3]
    _conserved(fresh)


def test_a_decode_fault_fails_the_running_batch_and_returns_its_kv(fresh):
    t, box = in_thread(fresh.generate, prompt="a long one", sampling_params={
        "max_new_tokens": 500, **GREEDY})
    wait_until(fresh, decoding)
    fresh.attach_fault_injector(FaultInjector(FailForwards(1)))
    t.join(60)
    assert _reason(box["out"])["type"] == "error"
    assert 0 < len(box["out"]["output_ids"]) < 500  # the tokens before the fault are kept
    _conserved(fresh)
    assert len(fresh.generate("next", {"max_new_tokens": 2, **GREEDY})["output_ids"]) == 2


def test_a_fault_in_a_chunked_prefill_returns_its_reserved_slots(tiny_llama_dir):
    with Engine(model=tiny_llama_dir, chunked_prefill_size=16, **OPTS) as engine:
        free_before = _conserved(engine)["free"]
        # the first chunk's pass, then the second's
        engine.attach_fault_injector(FaultInjector(FailForwards(2)))
        out = engine.generate(input_ids=list(range(1, 60)), sampling_params={"max_new_tokens": 2})
        assert _reason(out)["type"] == "error"
        kv = _conserved(engine)
        assert kv["free"] + kv["cached"] == free_before  # the first chunk's KV went to the cache


def test_nan_logits_fail_only_that_request(fresh):
    """Logits the model made non-finite end that request with a clear error; the rest of the
    batch goes on and no step counts as failed."""
    forward = fresh.runner.forward

    def poisoned(batch):
        logits = forward(batch).clone()  # an inference tensor: copy before writing
        if logits.shape[0] == 3:  # the prefill of the three prompts below: poison the second
            logits[1] = float("nan")
        return logits
    fresh.runner.forward = poisoned
    outs = fresh.generate(["one", "two", "three"], {"max_new_tokens": 4, **GREEDY})
    assert [_reason(o)["type"] for o in outs] == ["length", "error", "length"]
    assert "non-finite logits" in _reason(outs[1])["message"]
    assert fresh.health().failed_steps == 0
    _conserved(fresh)


def test_faults_on_every_step_fail_the_engine_and_callers_get_an_error(fresh):
    heard = []
    fresh.on_failure(heard.append)
    fresh.attach_fault_injector(FaultInjector(FailForwards(-1)))
    for step in range(3):  # each request gets its own batch's error; the third is fatal
        assert fresh.health().ok, step
        assert _reason(fresh.generate("x", {"max_new_tokens": 2}))["status"] == 500
    health = fresh.health()
    assert not health.ok and health.alive and health.consecutive_failed_steps == 3
    assert len(heard) == 1 and "3 scheduler steps failed in a row" in heard[0]
    assert "InjectedFault" in heard[0]
    with pytest.raises(EngineFailed, match="3 scheduler steps failed in a row"):
        # refused at once, never queued
        call_with_timeout(fresh.generate, prompt="y", sampling_params={"max_new_tokens": 2})
    late = []
    fresh.on_failure(late.append)  # a listener that comes late hears it at once
    assert late == heard
    _conserved(fresh)  # control calls still run on the failed engine's loop


def test_requests_waiting_when_the_engine_fails_end_with_an_error(fresh):
    """Requests queued behind the fatal step are not left waiting: they get the 503."""
    t, box = in_thread(fresh.generate, prompt="a long one", sampling_params={
        "max_new_tokens": 2000, **GREEDY})
    wait_until(fresh, decoding)
    fresh.scheduler.faults.max_consecutive = 1
    fresh.attach_fault_injector(FaultInjector(FailForwards(-1)))
    t.join(60)
    assert _reason(box["out"])["status"] == 500
    with pytest.raises(EngineFailed):
        fresh.generate("after", {"max_new_tokens": 2})


def test_a_dead_scheduler_thread_raises_instead_of_blocking(fresh):
    def die(_scheduler):
        raise SystemExit("scheduler thread killed by a test")
    t, box = in_thread(lambda: _catch(fresh.generate, "x", {"max_new_tokens": 50}))
    fresh.scheduler.on_step = die
    t.join(30)
    assert not t.is_alive(), "generate blocked on a dead scheduler"
    assert isinstance(box["out"], EngineFailed) and "thread died" in str(box["out"])
    with pytest.raises(EngineFailed, match="scheduler"):
        fresh.generate("x", {"max_new_tokens": 2})
    fresh._thread.join(30)
    assert not fresh.health().alive


def test_decode_fault_cleans_every_slot_of_a_big_batch(fresh):
    """Eight requests decoding together, a fault, then the invariant and the pool are whole."""
    prompts = [f"prompt number {i}" for i in range(8)]
    t, box = in_thread(fresh.generate, prompt=prompts, sampling_params={
        "max_new_tokens": 300, **GREEDY})
    wait_until(fresh, lambda s: len(s.queues.running) == 8 and all(r.output_ids for r in s.queues.running))
    fresh.attach_fault_injector(FaultInjector(FailForwards(1)))
    t.join(60)
    assert {_reason(o)["type"] for o in box["out"]} == {"error"}
    kv = _conserved(fresh)
    assert kv["free"] + kv["cached"] == kv["pool"]
