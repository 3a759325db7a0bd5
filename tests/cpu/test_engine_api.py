"""The public radixray.Engine surface: validation, stop conditions, streaming, seeds, abort,
cache reporting, priority preemption and logprobs (tiny random-weight Llama, CPU)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    FFFD,
    GREEDY,
    in_thread,
    is_running,
    rand_ids,
    stream,
    wait_until,
)

from radixray import Engine
from radixray.engine.executor.sampler import SampleOutput

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
        state = eng.call_in_loop(lambda s: ([r.rid for r in s.queues.running], len(s.queues.waiting)))
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


def test_the_model_is_built_on_the_thread_that_runs_it(tiny_llama_dir, monkeypatch, tmp_path):
    """libgomp keeps a team of threads for every thread that ran a parallel region and stops
    spinning once the process holds more than it has CPUs (engine/compute_thread.py): the
    engine builds its model runner on its scheduler thread, with the constructing thread's
    torch thread count, and a failure while building is raised by the constructor."""
    import threading

    from radixray.engine.executor.model_runner import ModelRunner
    built_on = []
    build = ModelRunner.__init__

    def recording(self, *args, **kwargs):
        built_on.append(threading.current_thread())
        build(self, *args, **kwargs)
    monkeypatch.setattr(ModelRunner, "__init__", recording)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with Engine(model=tiny_llama_dir, max_total_tokens=256) as eng:
            assert built_on == [eng._thread] and eng._thread is not threading.current_thread()
            assert eng.generate(input_ids=[1, 2, 3],
                                sampling_params={**GREEDY, "max_new_tokens": 4})["output_ids"]
            assert eng.call_in_loop(lambda _: torch.get_num_threads()) == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(Exception, match="missing-adapter"):
        Engine(model=tiny_llama_dir, max_total_tokens=256,
               lora_paths=[f"a={tmp_path / 'missing-adapter'}"])


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
    eng.call_in_loop(lambda s: setattr(s.output, "sampler", ScriptedSampler(script)))
    try:
        params = {"max_new_tokens": len(script), "ignore_eos": True}
        chunks = stream(eng, input_ids=[5, 6, 7], sampling_params=params)
        full = eng.generate(input_ids=[5, 6, 7], sampling_params=params)
    finally:
        eng.call_in_loop(lambda s: setattr(s.output, "sampler", real))
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


def test_stream_interval_coalesces_tokens(tiny_llama_dir):
    params = {**GREEDY, "max_new_tokens": 18, "ignore_eos": True}
    with Engine(model=tiny_llama_dir, max_total_tokens=2048, stream_interval=4) as eng4:
        full = eng4.generate(prompt="The quick brown fox", sampling_params=params)
        chunks = stream(eng4, prompt="The quick brown fox", sampling_params=params)
        assert [len(c["output_ids"]) for c in chunks] == [1, 4, 4, 4, 4, 1]  # first token at once
        assert [t for c in chunks for t in c["output_ids"]] == full["output_ids"]
        assert "".join(c["text"] for c in chunks) == full["text"]
        eng4.check_kv_conservation()
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        Engine(model=tiny_llama_dir, stream_interval=0)
