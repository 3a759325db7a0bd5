"""Engine control: abort, prefix-cache reporting, priority preemption, robustness."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from engine_helpers import (
    GREEDY,
    call_with_timeout,
    in_thread,
    is_gone,
    is_running,
    rand_ids,
    stream,
    wait_until,
)

from radixray import Engine


# ------------------------------------------------------------------ abort
def test_abort_by_rid(eng):
    prompt = rand_ids(eng.limits.vocab_size, 10, seed=9)
    before = eng.call_in_loop(lambda s: s.stats.num_aborted_reqs)
    thread, box = in_thread(eng.generate, input_ids=prompt, rid="long-1",
                            sampling_params={**GREEDY, "max_new_tokens": 900})
    wait_until(eng, is_running("long-1", 5))
    eng.abort("long-1")
    thread.join(30)
    out = box["out"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 5 <= len(out["output_ids"]) < 900
    assert eng.call_in_loop(lambda s: s.stats.num_aborted_reqs) == before + 1
    eng.abort("no-such-request")  # unknown ids are ignored
    state = eng.check_kv_conservation()
    assert state["running"] == state["waiting"] == 0


def test_closing_a_stream_early_aborts_it(eng):
    prompt = rand_ids(eng.limits.vocab_size, 10, seed=10)
    before = eng.call_in_loop(lambda s: s.stats.num_aborted_reqs)

    async def read_three():
        agen = eng.generate_stream(input_ids=prompt, rid="stream-1",
                                   sampling_params={**GREEDY, "max_new_tokens": 900})
        got = []
        async for chunk in agen:
            got.append(chunk)
            if len(got) == 3:
                break
        await agen.aclose()
        return got
    got = asyncio.run(read_three())
    assert len(got) == 3 and not got[-1]["finished"]
    wait_until(eng, is_gone("stream-1"), timeout=3.0)  # far less than 900 decode steps
    assert eng.call_in_loop(lambda s: s.stats.num_aborted_reqs) == before + 1
    eng.check_kv_conservation()


# ------------------------------------------------------------------ prefix cache
def test_cached_tokens_reports_the_shared_prefix(eng):
    vocab = eng.limits.vocab_size
    assert eng.flush_cache()
    a = rand_ids(vocab, 50, seed=11)
    b = a[:30] + rand_ids(vocab, 20, seed=12)
    b[30] = a[30] % (vocab - 1) + 1  # differ right after the shared 30 tokens
    assert b[30] != a[30]
    params = {**GREEDY, "max_new_tokens": 3}
    first = eng.generate(input_ids=a, sampling_params=params)
    assert first["meta_info"]["cached_tokens"] == 0
    assert eng.generate(input_ids=b, sampling_params=params)["meta_info"]["cached_tokens"] == 30
    again = eng.generate(input_ids=a, sampling_params=params)
    assert again["meta_info"]["cached_tokens"] == len(a) - 1  # the last prompt token always runs
    assert again["output_ids"] == first["output_ids"]
    state = eng.check_kv_conservation()
    assert state["cached"] > 0


def test_disable_radix_cache_reports_no_hits(tiny_llama_dir):
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=1024,
                disable_radix_cache=True, check_kv_conservation=True) as eng:
        a = rand_ids(eng.limits.vocab_size, 50, seed=13)
        params = {**GREEDY, "max_new_tokens": 3}
        outs = [eng.generate(input_ids=a, sampling_params=params) for _ in range(2)]
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0]
        assert outs[0]["output_ids"] == outs[1]["output_ids"]
        state = eng.check_kv_conservation()
        assert state["cached"] == 0 and state["free"] == state["pool"]


# ------------------------------------------------------------------ priority
def test_priority_preemption(tiny_llama_dir):
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096,
                max_running_requests=1, enable_priority_scheduling=True,
                check_kv_conservation=True) as eng:
        vocab = eng.limits.vocab_size
        low_prompt, other = rand_ids(vocab, 20, seed=14), rand_ids(vocab, 20, seed=15)
        low_params = {**GREEDY, "max_new_tokens": 200}
        ref = eng.generate(input_ids=low_prompt, sampling_params=low_params)["output_ids"]
        assert eng.flush_cache()

        # 20 beats 0 by more than the preemption threshold (10): the low one is retracted.
        thread, low = in_thread(eng.generate, input_ids=low_prompt, sampling_params=low_params,
                                rid="low", priority=0)
        wait_until(eng, is_running("low", 10))
        high = eng.generate(input_ids=other, sampling_params={**GREEDY, "max_new_tokens": 10},
                            priority=20)
        t_high = time.perf_counter()
        thread.join(60)
        assert high["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
        assert t_high < low["t"]
        assert low["out"]["meta_info"]["num_retractions"] >= 1
        assert low["out"]["output_ids"] == ref  # resumed from where it was, same tokens
        assert eng.call_in_loop(lambda s: s.stats.num_retracted_reqs) >= 1

        # 5 does not beat 0 by more than 10: the newcomer waits its turn.
        retracted = eng.call_in_loop(lambda s: s.stats.num_retracted_reqs)
        thread, low = in_thread(eng.generate, input_ids=low_prompt, sampling_params=low_params,
                                rid="low-2", priority=0)
        wait_until(eng, is_running("low-2", 10))
        mid = eng.generate(input_ids=other, sampling_params={**GREEDY, "max_new_tokens": 10},
                           priority=5)
        t_mid = time.perf_counter()
        thread.join(60)
        assert low["t"] < t_mid
        assert low["out"]["meta_info"]["num_retractions"] == 0
        assert mid["meta_info"]["finish_reason"]["type"] == "length"
        assert eng.call_in_loop(lambda s: s.stats.num_retracted_reqs) == retracted
        eng.check_kv_conservation()


def test_priority_preempts_only_as_many_as_needed(tiny_llama_dir):
    """One free row is enough for one newcomer: only one low-priority request is retracted."""
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096,
                max_running_requests=2, enable_priority_scheduling=True,
                check_kv_conservation=True) as eng:
        vocab = eng.limits.vocab_size
        lows = [rand_ids(vocab, 20, seed=16), rand_ids(vocab, 20, seed=17)]
        low_params = {**GREEDY, "max_new_tokens": 200}
        thread, low = in_thread(eng.generate, input_ids=lows, sampling_params=low_params,
                                rid=["low-a", "low-b"], priority=0)
        wait_until(eng, lambda s: len(s.queues.running) == 2 and
                   min(len(r.output_ids) for r in s.queues.running) >= 10)
        high = eng.generate(input_ids=rand_ids(vocab, 20, seed=18),
                            sampling_params={**GREEDY, "max_new_tokens": 10}, priority=50)
        thread.join(60)
        assert high["meta_info"]["num_retractions"] == 0
        assert sorted(o["meta_info"]["num_retractions"] for o in low["out"]) == [0, 1]
        assert all(len(o["output_ids"]) == 200 for o in low["out"])
        assert eng.call_in_loop(lambda s: s.stats.num_retracted_reqs) == 1
        eng.check_kv_conservation()


# ------------------------------------------------------------------ robustness
def test_request_ids_must_be_unique_while_in_use(eng):
    # Two requests under one id: one of the callers used to wait forever.
    # One id for a batch names the batch: its prompts run as id_0, id_1 (as SGLang's).
    outs = call_with_timeout(eng.generate, input_ids=[[1, 2], [3, 4]], rid="same",
                             sampling_params={"max_new_tokens": 1})
    assert [o["meta_info"]["id"] for o in outs] == ["same_0", "same_1"]
    with pytest.raises(ValueError, match="rid"):
        call_with_timeout(eng.generate, input_ids=[[1, 2], [3, 4]], rid=["x", "x"])
    thread, box = in_thread(eng.generate, input_ids=[1, 2, 3], rid="dup",
                            sampling_params={**GREEDY, "max_new_tokens": 300})
    wait_until(eng, is_running("dup"))
    with pytest.raises(ValueError, match="already in use"):
        call_with_timeout(eng.generate, input_ids=[4, 5, 6], rid="dup")
    with pytest.raises(ValueError, match="already in use"):
        stream(eng, input_ids=[4, 5, 6], rid="dup")
    thread.join(30)
    assert box["out"]["meta_info"]["finish_reason"] == {"type": "length", "length": 300}
    # Once finished, the id may be used again.
    again = eng.generate(input_ids=[4, 5, 6], rid="dup", sampling_params={"max_new_tokens": 2})
    assert again["meta_info"]["id"] == "dup"
    eng.check_kv_conservation()


def test_abandoned_stream_does_not_kill_the_scheduler(eng):
    """A stream whose event loop closed without closing the generator: the request is aborted
    and the engine keeps serving (it used to crash the scheduler thread)."""
    before = eng.call_in_loop(lambda s: s.stats.num_aborted_reqs)
    loop = asyncio.new_event_loop()
    agen = eng.generate_stream(input_ids=[1, 2, 3], rid="orphan",
                               sampling_params={**GREEDY, "max_new_tokens": 900})
    first = loop.run_until_complete(agen.__anext__())
    assert not first["finished"]
    loop.close()
    wait_until(eng, is_gone("orphan"), timeout=3.0)
    assert eng.call_in_loop(lambda s: s.stats.num_aborted_reqs) == before + 1
    out = eng.generate(input_ids=[4, 5, 6], sampling_params={**GREEDY, "max_new_tokens": 4})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    eng.check_kv_conservation()


def test_generation_stops_at_the_context_length(eng):
    context = eng.limits.context_len
    prompt = rand_ids(eng.limits.vocab_size, context - 10, seed=20)
    out = eng.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 50})
    assert len(prompt) + len(out["output_ids"]) == context
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    eng.check_kv_conservation()


def test_flush_cache_refuses_while_requests_hold_kv(eng):
    thread, box = in_thread(eng.generate, input_ids=[7, 8, 9], rid="holder",
                            sampling_params={**GREEDY, "max_new_tokens": 300})
    wait_until(eng, is_running("holder"))
    assert eng.flush_cache() is False
    thread.join(30)
    assert eng.flush_cache() is True
    state = eng.check_kv_conservation()
    assert state["cached"] == 0 and state["free"] == state["pool"]


def test_abort_waiting_and_chunked_requests(tiny_llama_dir):
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=2048,
                max_running_requests=1, chunked_prefill_size=16,
                check_kv_conservation=True) as eng:
        vocab = eng.limits.vocab_size
        # Abort in the middle of a chunked prefill (16 tokens per step, 400-token prompt).
        thread, chunky = in_thread(eng.generate, input_ids=rand_ids(vocab, 400, seed=21),
                                   rid="chunky", sampling_params={"max_new_tokens": 5})

        def abort_mid_prefill(s):
            if s.queues.chunked is not None and s.queues.chunked.rid == "chunky" \
                    and s.queues.chunked.kv_len >= 32:
                return s.abort("chunky", "test abort")
            return False
        wait_until(eng, abort_mid_prefill)
        thread.join(30)
        assert chunky["out"]["meta_info"]["finish_reason"] == {"type": "abort",
                                                               "message": "test abort"}
        assert chunky["out"]["output_ids"] == []
        eng.check_kv_conservation()

        # Abort a request that is still waiting for the only row.
        runner_prompt = rand_ids(vocab, 10, seed=22)
        params = {**GREEDY, "max_new_tokens": 200}
        ref = eng.generate(input_ids=runner_prompt, sampling_params=params)["output_ids"]
        t_run, runner = in_thread(eng.generate, input_ids=runner_prompt, rid="runner",
                                  sampling_params=params)
        wait_until(eng, is_running("runner"))
        t_wait, queued = in_thread(eng.generate, input_ids=rand_ids(vocab, 10, seed=23),
                                   rid="queued", sampling_params=params)
        wait_until(eng, lambda s: any(r.rid == "queued" for r in s.queues.waiting))
        eng.abort("queued")
        t_wait.join(30)
        t_run.join(30)
        meta = queued["out"]["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and queued["out"]["output_ids"] == []
        assert meta["queue_time"] is None  # it was never admitted
        assert runner["out"]["output_ids"] == ref
        state = eng.check_kv_conservation()
        assert state["running"] == state["waiting"] == 0


def test_shutdown_ends_unfinished_requests(tiny_llama_dir):
    eng = Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=1024,
                 max_running_requests=1, check_kv_conservation=True)
    params = {**GREEDY, "max_new_tokens": 900}
    t_run, running = in_thread(eng.generate, input_ids=[1, 2, 3], rid="running", sampling_params=params)
    wait_until(eng, is_running("running"))
    t_wait, waiting = in_thread(eng.generate, input_ids=[4, 5, 6], rid="waiting", sampling_params=params)
    wait_until(eng, lambda s: len(s.queues.waiting) == 1)

    async def read_stream(got: list):
        async for chunk in eng.generate_stream(input_ids=[7, 8], sampling_params=params):
            got.append(chunk)
    chunks: list = []
    t_stream = threading.Thread(target=lambda: asyncio.run(read_stream(chunks)), daemon=True)
    t_stream.start()
    wait_until(eng, lambda s: len(s.queues.waiting) == 2)
    eng.shutdown()
    for t in (t_run, t_wait, t_stream):
        t.join(10)
        assert not t.is_alive(), "a caller still waits after shutdown"
    for box in (running, waiting):
        assert box["out"]["meta_info"]["finish_reason"] == {"type": "abort",
                                                            "message": "engine shut down"}
    assert chunks[-1]["finished"] and chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate(input_ids=[1, 2])
    eng.shutdown()  # idempotent
    eng.scheduler.check_kv_conservation()


THREADS_SCRIPT = """
import ctypes, os, sys, torch
from radixray import Engine
lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1"))
with Engine(model=sys.argv[1], dtype="float32", max_total_tokens=256, num_threads=2) as eng:
    print("SCHEDULER_OMP_THREADS", eng.call_in_loop(lambda s: lib.omp_get_max_threads()))
"""


def test_scheduler_thread_runs_with_the_configured_threads(tiny_llama_dir):
    """Ray starts actors with OMP_NUM_THREADS=<cpus>; the scheduler thread must still use num_threads."""
    import os
    import subprocess
    import sys

    import torch
    if not os.path.exists(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")):
        pytest.skip("torch build without GNU OpenMP")
    out = subprocess.run([sys.executable, "-c", THREADS_SCRIPT, tiny_llama_dir], text=True,
                         capture_output=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "SCHEDULER_OMP_THREADS 2" in out.stdout
