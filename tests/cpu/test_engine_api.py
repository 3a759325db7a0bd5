"""The public radixray.Engine surface: validation, stop conditions, streaming, seeds, abort,
cache reporting, priority preemption and logprobs (tiny random-weight Llama, CPU)."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch

from radixray import Engine
from radixray.engine.sampler import SampleOutput

FFFD = "\ufffd"
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def eng(tiny_llama_dir):
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=8192,
                check_kv_conservation=True) as engine:
        yield engine
        engine.check_kv_conservation()


def rand_ids(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]


def wait_until(engine: Engine, pred, timeout: float = 30.0) -> None:
    """Poll ``pred(scheduler)`` on the scheduler thread until it holds."""
    deadline = time.monotonic() + timeout
    while not engine.call_in_loop(pred):
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def is_running(rid: str, min_outputs: int = 1):
    return lambda s: any(r.rid == rid and len(r.output_ids) >= min_outputs for r in s.running)


def is_gone(rid: str):
    return lambda s: all(r.rid != rid for r in s.running + s.waiting) and (
        s.chunked_req is None or s.chunked_req.rid != rid)


def in_thread(fn, **kwargs):
    """Run ``fn(**kwargs)`` in a thread; returns (thread, results dict with 'out' and 't')."""
    box: dict = {}

    def target():
        box["out"] = fn(**kwargs)
        box["t"] = time.perf_counter()
    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def call_with_timeout(fn, timeout: float = 30.0, **kwargs):
    """``fn(**kwargs)`` in a thread: its result, or its exception re-raised; fails on a hang."""
    box: dict = {}

    def target():
        try:
            box["out"] = fn(**kwargs)
        except Exception as exc:  # re-raised in the caller
            box["exc"] = exc
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise AssertionError(f"{getattr(fn, '__name__', fn)} hung")
    if "exc" in box:
        raise box["exc"]
    return box["out"]


def stream(engine: Engine, **kwargs) -> list[dict]:
    async def collect():
        return [c async for c in engine.generate_stream(**kwargs)]
    return asyncio.run(collect())


# ------------------------------------------------------------------ validation
BAD_INPUTS = [
    (dict(prompt=""), "prompt 0 is empty"),
    (dict(input_ids=[]), "prompt 0 is empty"),
    (dict(input_ids=[[1, 2, 3], []]), "prompt 1 is empty"),  # one bad prompt rejects the batch
    (dict(prompt=[]), "prompt"),
    (dict(input_ids=[5] * 1024), "context length"),
    (dict(input_ids=[1, 2, 100_000]), "outside the vocabulary"),
    (dict(input_ids=[1, -1]), "outside the vocabulary"),
    (dict(input_ids=[1], sampling_params={"max_new_tokens": -1}), "max_new_tokens"),
    (dict(input_ids=[1], sampling_params={"max_new_tokens": "9"}), "max_new_tokens"),
    (dict(input_ids=[1], sampling_params={"temperature": -0.5}), "temperature"),
    (dict(input_ids=[1], sampling_params={"temperature": float("nan")}), "temperature"),
    (dict(input_ids=[1], sampling_params={"top_p": 0}), "top_p"),
    (dict(input_ids=[1], sampling_params={"top_p": 1.5}), "top_p"),
    (dict(input_ids=[1], sampling_params={"top_k": -2}), "top_k"),
    (dict(input_ids=[1], sampling_params={"top_k": 0}), "top_k"),
    (dict(input_ids=[1], sampling_params={"stop": 5}), "stop"),
    (dict(input_ids=[1], sampling_params={"stop": [""]}), "stop"),
    (dict(input_ids=[1], sampling_params={"stop_token_ids": [100_000]}), "stop_token_ids"),
    (dict(input_ids=[1], sampling_params={"temprature": 0.5}), "temprature"),
    (dict(input_ids=[[1], [2]], sampling_params=[{}, {"top_p": 2.0}]), "top_p"),
    (dict(input_ids=[[1], [2]], sampling_params=[{}]), "sampling_params"),
    (dict(input_ids=[1], priority="high"), "priority"),
]


def test_bad_input_is_rejected_before_anything_is_scheduled(eng):
    vocab = eng.limits.vocab_size
    prompt = rand_ids(vocab, 20, seed=1)
    params = {**GREEDY, "max_new_tokens": 300}
    ref = eng.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    eng.flush_cache()

    submitted = []
    real_submit = eng.scheduler.submit

    def spy(item):
        if isinstance(item, list):
            submitted.extend(r.rid for r in item)
        real_submit(item)
    eng.scheduler.submit = spy
    try:
        thread, box = in_thread(eng.generate, input_ids=prompt, sampling_params=params,
                                rid="bystander")
        wait_until(eng, is_running("bystander", 5))
        for kwargs, field in BAD_INPUTS:
            with pytest.raises(ValueError, match=field):
                eng.generate(**kwargs)
        with pytest.raises(ValueError, match="top_p"):
            stream(eng, input_ids=[1, 2], sampling_params={"top_p": 0})
        with pytest.raises(ValueError, match="one prompt"):
            stream(eng, input_ids=[[1, 2], [3]])
        assert submitted == ["bystander"]
        state = eng.call_in_loop(lambda s: ([r.rid for r in s.running], len(s.waiting)))
        assert state in ((["bystander"], 0), ([], 0))
        thread.join(30)
    finally:
        eng.scheduler.submit = real_submit
    out = box["out"]
    assert out["output_ids"] == ref
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 300}
    eng.check_kv_conservation()


def test_bad_engine_option_names_the_option(tiny_llama_dir):
    with pytest.raises(TypeError, match="max_total_token"):
        Engine(model=tiny_llama_dir, max_total_token=100)
    with pytest.raises(ValueError, match="schedule_policy"):
        Engine(model=tiny_llama_dir, schedule_policy="random")


# ------------------------------------------------------------------ stop conditions
def boundary_stop(tokenizer, out_ids: list[int], text: str) -> tuple[str, int]:
    """A 4-character stop string whose first occurrence in ``text`` straddles a token boundary."""
    for k in range(2, len(out_ids) - 1):
        head = tokenizer.decode(out_ids[:k], skip_special_tokens=True)
        b = len(head)
        if not text.startswith(head) or b < 2 or b + 2 > len(text):
            continue
        s = text[b - 2:b + 2]
        if FFFD in s or not s.strip() or text.find(s) != b - 2:
            continue
        return s, b - 2
    raise AssertionError(f"no stop string candidate in {text!r}")


def test_stop_string_spanning_tokens(eng):
    tok = eng.tokenizer
    prompt = "Hello world, this is a test."
    full = eng.generate(prompt=prompt, sampling_params={**GREEDY, "max_new_tokens": 60})
    text, ids = full["text"], full["output_ids"]
    stop, idx = boundary_stop(tok, ids, text)

    out = eng.generate(prompt=prompt, sampling_params={**GREEDY, "max_new_tokens": 60,
                                                       "stop": [stop, "never-seen-zq"]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[:idx]
    # Generation stopped at the token that completed the stop string.
    n = len(out["output_ids"])
    assert out["output_ids"] == ids[:n]
    assert stop in tok.decode(ids[:n], skip_special_tokens=True)
    assert stop not in tok.decode(ids[:n - 1], skip_special_tokens=True)
    # A single string is accepted too; streaming never releases any part of the stop string.
    chunks = stream(eng, prompt=prompt, sampling_params={**GREEDY, "max_new_tokens": 60,
                                                         "stop": stop})
    assert "".join(c["text"] for c in chunks) == text[:idx]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    eng.check_kv_conservation()


def test_stop_token_ids(eng):
    prompt = rand_ids(eng.limits.vocab_size, 12, seed=2)
    ids = eng.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 40})[
        "output_ids"]
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    out = eng.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 40,
                                                          "stop_token_ids": [ids[k]]})
    assert out["output_ids"] == ids[:k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[k]}
    eng.check_kv_conservation()


def test_eos_stops_unless_ignored(eng):
    """The model's EOS (id 0 in the tiny models) ends generation unless ignore_eos is set."""
    vocab = eng.limits.vocab_size
    for seed in range(100, 120):
        prompt = rand_ids(vocab, 40, seed=seed)
        ids = eng.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 60})[
            "output_ids"]
        if 0 in ids:
            break
    else:
        pytest.skip("the tiny model never produced EOS")
    out = eng.generate(input_ids=prompt, sampling_params={"temperature": 0.0,
                                                          "max_new_tokens": 60})
    assert out["output_ids"] == ids[:ids.index(0) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 0}
    assert "<|endoftext|>" not in out["text"]  # special tokens are skipped in text
    eng.check_kv_conservation()


def test_max_new_tokens_zero(eng):
    vocab = eng.limits.vocab_size
    prompt = rand_ids(vocab, 15, seed=3)
    out = eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert out["meta_info"]["prompt_tokens"] == 15
    assert out["meta_info"]["completion_tokens"] == 0
    # Mixed in one prefill batch with a request that does generate.
    other = rand_ids(vocab, 9, seed=4)
    alone = eng.generate(input_ids=other, sampling_params={**GREEDY, "max_new_tokens": 6})
    both = eng.generate(input_ids=[rand_ids(vocab, 15, seed=5), other],
                        sampling_params=[{"max_new_tokens": 0}, {**GREEDY, "max_new_tokens": 6}])
    assert both[0]["output_ids"] == [] and both[1]["output_ids"] == alone["output_ids"]
    chunks = stream(eng, input_ids=prompt, sampling_params={"max_new_tokens": 0})
    assert len(chunks) == 1 and chunks[0]["finished"] and chunks[0]["output_ids"] == []
    assert chunks[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    eng.check_kv_conservation()


# ------------------------------------------------------------------ streaming
@pytest.mark.parametrize("params", [
    {**GREEDY, "max_new_tokens": 50},
    {"temperature": 1.0, "seed": 1234, "max_new_tokens": 50},
    {"temperature": 1.3, "top_k": 50, "seed": 99, "max_new_tokens": 50, "ignore_eos": True},
])
def test_stream_equals_generate(eng, params):
    prompt = "The quick brown fox"
    full = eng.generate(prompt=prompt, sampling_params=params)
    chunks = stream(eng, prompt=prompt, sampling_params=params)
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [t for c in chunks for t in c["output_ids"]] == full["output_ids"]
    assert [c["finished"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "meta_info" in chunks[-1] and all("meta_info" not in c for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["completion_tokens"] == len(full["output_ids"])
    assert len(chunks) > 1
    eng.check_kv_conservation()


class ScriptedSampler:
    """Emits a fixed token sequence (by output position), whatever the logits say."""

    def __init__(self, script: list[int]):
        self.script = script

    def sample(self, logits, params, generators, histories):
        return SampleOutput(token_ids=[self.script[len(h)] for h in histories])


def test_stream_holds_back_incomplete_utf8(eng):
    tok = eng.tokenizer
    target = "日本語 🚀 ñandú 中文 über 👍"
    script = tok.encode(target)
    # The test only means something if characters are split across byte tokens.
    assert sum(FFFD in tok.decode([t]) for t in script) >= 10
    real = eng.call_in_loop(lambda s: s.sampler)
    eng.call_in_loop(lambda s: setattr(s, "sampler", ScriptedSampler(script)))
    try:
        params = {"max_new_tokens": len(script), "ignore_eos": True}
        chunks = stream(eng, input_ids=[5, 6, 7], sampling_params=params)
        full = eng.generate(input_ids=[5, 6, 7], sampling_params=params)
    finally:
        eng.call_in_loop(lambda s: setattr(s, "sampler", real))
    assert full["output_ids"] == script and full["text"] == target
    texts = [c["text"] for c in chunks]
    assert "".join(texts) == target
    assert not any(FFFD in t for t in texts), texts
    assert "" in texts  # some steps produced only part of a character and released nothing
    eng.check_kv_conservation()


# ------------------------------------------------------------------ seeds
def test_seed_reproduces_sampled_output_alone_and_batched(eng):
    vocab = eng.limits.vocab_size
    prompt = rand_ids(vocab, 16, seed=6)
    params = {"temperature": 1.0, "top_p": 0.95, "seed": 42, "max_new_tokens": 30,
              "ignore_eos": True}
    alone = eng.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    again = eng.generate(input_ids=prompt, sampling_params=params)["output_ids"]
    assert again == alone
    others = [rand_ids(vocab, 10, seed=7), rand_ids(vocab, 25, seed=8)]
    batch = eng.generate(input_ids=[others[0], prompt, others[1]], sampling_params=[
        {"temperature": 1.0, "max_new_tokens": 30},
        params,
        {**params, "seed": 7}])
    assert batch[1]["output_ids"] == alone
    other_seed = eng.generate(input_ids=prompt, sampling_params={**params, "seed": 43})
    assert other_seed["output_ids"] != alone
    eng.check_kv_conservation()


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
        wait_until(eng, lambda s: len(s.running) == 2 and
                   min(len(r.output_ids) for r in s.running) >= 10)
        high = eng.generate(input_ids=rand_ids(vocab, 20, seed=18),
                            sampling_params={**GREEDY, "max_new_tokens": 10}, priority=50)
        thread.join(60)
        assert high["meta_info"]["num_retractions"] == 0
        assert sorted(o["meta_info"]["num_retractions"] for o in low["out"]) == [0, 1]
        assert all(len(o["output_ids"]) == 200 for o in low["out"])
        assert eng.call_in_loop(lambda s: s.stats.num_retracted_reqs) == 1
        eng.check_kv_conservation()


# ------------------------------------------------------------------ logprobs
def test_logprobs_when_asked(eng, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    prompt = rand_ids(eng.limits.vocab_size, 12, seed=19)
    plain = eng.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 8})
    assert "output_token_logprobs" not in plain and "output_top_logprobs" not in plain
    out = eng.generate(input_ids=prompt, sampling_params={
        **GREEDY, "max_new_tokens": 8, "return_logprob": True, "top_logprobs_num": 3})
    ids, lps, tops = out["output_ids"], out["output_token_logprobs"], out["output_top_logprobs"]
    assert ids == plain["output_ids"]
    assert len(lps) == len(tops) == len(ids) == 8
    for tok, lp, top in zip(ids, lps, tops):
        assert len(top) == 3
        assert top[0][0] == tok and top[0][1] == pytest.approx(lp)  # greedy: the top token
        assert top[0][1] >= top[1][1] >= top[2][1]
        assert lp <= 0.0
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([prompt + ids[:-1]])).logits[0, len(prompt) - 1:]
    ref = torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(ids)), torch.tensor(ids)]
    assert lps == pytest.approx(ref.tolist(), abs=1e-4)
    # Streams carry them chunk by chunk.
    chunks = stream(eng, input_ids=prompt, sampling_params={
        **GREEDY, "max_new_tokens": 8, "return_logprob": True})
    assert [x for c in chunks for x in c["output_token_logprobs"]] == pytest.approx(lps)
    eng.check_kv_conservation()


# ------------------------------------------------------------------ robustness
def test_request_ids_must_be_unique_while_in_use(eng):
    # Two requests under one id: one of the callers used to wait forever.
    with pytest.raises(ValueError, match="rid"):
        call_with_timeout(eng.generate, input_ids=[[1, 2], [3, 4]], rid="same")
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
            if s.chunked_req is not None and s.chunked_req.rid == "chunky" \
                    and s.chunked_req.kv_len >= 32:
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
        wait_until(eng, lambda s: any(r.rid == "queued" for r in s.waiting))
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
    wait_until(eng, lambda s: len(s.waiting) == 1)

    async def read_stream(got: list):
        async for chunk in eng.generate_stream(input_ids=[7, 8], sampling_params=params):
            got.append(chunk)
    chunks: list = []
    t_stream = threading.Thread(target=lambda: asyncio.run(read_stream(chunks)), daemon=True)
    t_stream.start()
    wait_until(eng, lambda s: len(s.waiting) == 2)
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
