"""Prompt-token logprobs (``input_token_logprobs``) equal Hugging Face's log-softmax over the
prompt (fp32, 1e-5): alone, after a cached prefix, in chunked prefill, from a start position,
with top logprobs; and the same through native /generate and OpenAI completions ``echo``."""

from __future__ import annotations

import random

import httpx
import pytest
import torch
from serving_helpers import free_port, served, tiny_config

TOL = 1e-5


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row t is log_softmax of the logits after tokens 0..t."""
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def prompt(hf, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, hf.config.vocab_size) for _ in range(n)]


def assert_input_logprobs(hf, ids: list[int], got: list, start: int = 0) -> None:
    """``got`` is one entry per prompt position from ``start``: None, then the logprob of
    each token after those before it, equal to HF's within TOL."""
    ref = hf_logprobs(hf, ids)
    assert len(got) == len(ids) - start and got[0] is None
    want = [ref[t - 1, ids[t]].item() for t in range(start + 1, len(ids))]
    diff = max(abs(a - b) for a, b in zip(got[1:], want, strict=True)) if want else 0.0
    assert diff <= TOL, f"largest difference from HF {diff:.3e}"


def asked(start: int = 0, **extra) -> dict:
    return {"max_new_tokens": 2, "temperature": 0, "return_logprob": True,
            "logprob_start_len": start, **extra}


# ---- engine ---------------------------------------------------------------------------------
def test_equal_to_hf_with_and_without_a_cached_prefix(eng, hf):
    ids = prompt(hf, 40, seed=1)
    eng.flush_cache()
    out = eng.generate(input_ids=ids, sampling_params=asked())
    assert out["meta_info"]["cached_tokens"] == 0
    assert_input_logprobs(hf, ids, out["input_token_logprobs"])
    # the same prompt again: its prefix is cached, and recomputed for the logprobs
    again = eng.generate(input_ids=ids, sampling_params=asked())
    assert again["meta_info"]["cached_tokens"] == 0
    assert again["input_token_logprobs"] == out["input_token_logprobs"]
    # an extended prompt after a plain request cached 30 of its tokens
    longer = ids + prompt(hf, 12, seed=2)
    plain = eng.generate(input_ids=longer, sampling_params={"max_new_tokens": 1})
    assert plain["meta_info"]["cached_tokens"] >= len(ids)  # the cache holds the prefix
    assert_input_logprobs(hf, longer, eng.generate(input_ids=longer, sampling_params=asked())
                          ["input_token_logprobs"])
    # from a start position, the cached prefix before it is reused
    out = eng.generate(input_ids=longer, sampling_params=asked(start=17))
    assert out["meta_info"]["cached_tokens"] == 17
    assert_input_logprobs(hf, longer, out["input_token_logprobs"], start=17)
    eng.check_kv_conservation()


def test_default_start_reports_only_the_last_prompt_token(eng, hf):
    ids = prompt(hf, 9, seed=3)
    out = eng.generate(input_ids=ids, sampling_params={"return_logprob": True,
                                                       "top_logprobs_num": 2,
                                                       "max_new_tokens": 1})
    assert out["input_token_logprobs"] == [None] and out["input_top_logprobs"] == [None]
    plain = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
    assert "input_token_logprobs" not in plain


def test_top_logprobs_equal_hf_topk_and_are_not_temperature_scaled(eng, hf):
    ids = prompt(hf, 20, seed=4)
    ref = hf_logprobs(hf, ids)
    out = eng.generate(input_ids=ids, sampling_params=asked(
        start=3, top_logprobs_num=4, temperature=0.5, seed=7))
    assert_input_logprobs(hf, ids, out["input_token_logprobs"], start=3)
    tops = out["input_top_logprobs"]
    assert len(tops) == len(ids) - 3 and tops[0] is None
    for i, top in enumerate(tops[1:], start=3):
        vals, idx = ref[i].topk(4)
        assert [t for t, _ in top] == idx.tolist()
        assert max(abs(v - w) for (_, v), w in zip(top, vals.tolist())) <= TOL


def test_max_new_tokens_zero_scores_the_prompt_only(eng, hf):
    ids = prompt(hf, 15, seed=5)
    out = eng.generate(input_ids=ids, sampling_params=asked(max_new_tokens=0))
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    assert_input_logprobs(hf, ids, out["input_token_logprobs"])


def test_bad_start_is_refused_naming_the_field(eng, hf):
    ids = prompt(hf, 5, seed=6)
    with pytest.raises(ValueError, match="logprob_start_len"):
        eng.generate(input_ids=ids, sampling_params=asked(start=5))
    with pytest.raises(ValueError, match="logprob_start_len"):
        eng.generate(input_ids=ids, sampling_params=asked(start=-2))
    # without return_logprob the position is not used
    assert eng.generate(input_ids=ids, sampling_params={"logprob_start_len": 9,
                                                        "max_new_tokens": 1})["output_ids"]


def test_chunked_mixed_batches_in_bounded_projection_chunks(tiny_llama_dir, hf, monkeypatch):
    """8-token prefill chunks, decode riders (mixed chunks: the first prompt decodes while
    the others prefill) and the overlap scheduler, a batch of prompts with different
    starts, and logits projected 3 rows at a time."""
    from radixray import Engine
    from radixray.engine.executor import prompt_logprobs
    monkeypatch.setattr(prompt_logprobs, "LOGIT_CHUNK_BYTES", 4 * hf.config.vocab_size * 3)
    prompts = [prompt(hf, n, seed=10 + n) for n in (30, 7, 19)]
    starts = [0, 2, 11]
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096,
                chunked_prefill_size=8, enable_mixed_chunk=True, enable_overlap_schedule=True,
                check_kv_conservation=True) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=[
            asked(start=s, top_logprobs_num=2, max_new_tokens=8) for s in starts])
        for ids, s, out in zip(prompts, starts, outs):
            assert_input_logprobs(hf, ids, out["input_token_logprobs"], start=s)
            assert len(out["input_top_logprobs"]) == len(ids) - s
        assert eng.snapshot().mixed_forwards > 0
        eng.check_kv_conservation()


# ---- HTTP -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with served(tiny_config(tiny_llama_dir, free_port())) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_native_generate_returns_sglang_input_logprob_fields(server, hf, tok):
    ids = prompt(hf, 16, seed=20)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
            "return_text_in_logprobs": True}
    meta = httpx.post(f"{server}/generate", json=body, timeout=120).json()["meta_info"]
    entries = meta["input_token_logprobs"]
    assert [t for _, t, _ in entries] == ids
    assert [text for _, _, text in entries] == [tok.decode([t]) for t in ids]
    assert_input_logprobs(hf, ids, [lp for lp, _, _ in entries])
    tops = meta["input_top_logprobs"]
    assert tops[0] is None and all(len(top) == 2 and len(top[0]) == 3 for top in tops[1:])
    assert len(meta["output_token_logprobs"]) == 2
    default = httpx.post(f"{server}/generate", json={**body, "logprob_start_len": -1,
                                                     "return_text_in_logprobs": False},
                         timeout=120).json()["meta_info"]
    assert default["input_token_logprobs"] == [[None, ids[-1], None]]
    bad = httpx.post(f"{server}/generate", json={**body, "logprob_start_len": 16}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprob_start_len"


def test_echo_through_the_openai_client(client, hf, tok):
    text = "the quick brown fox jumps"
    ids = tok.encode(text)
    scored = client.completions.create(model="tiny", prompt=text, echo=True, logprobs=1,
                                       max_tokens=0)
    c = scored.choices[0]
    assert c.text == text and c.finish_reason == "length"
    assert c.logprobs.tokens == [tok.decode([t]) for t in ids]
    assert c.logprobs.top_logprobs[0] is None and all(len(t) == 1 for t in c.logprobs.top_logprobs[1:])
    assert_input_logprobs(hf, ids, c.logprobs.token_logprobs)
    assert scored.usage.prompt_tokens == len(ids) and scored.usage.completion_tokens == 0
    # lm-eval's loglikelihood request: token ids, echo, one token generated
    one = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1,
                                    max_tokens=1, temperature=0).choices[0]
    assert len(one.logprobs.token_logprobs) == len(ids) + 1
    assert one.logprobs.token_logprobs[:-1] == c.logprobs.token_logprobs
    assert one.text.startswith(tok.decode(ids))
    offsets = one.logprobs.text_offset
    assert offsets == [sum(len(t) for t in one.logprobs.tokens[:i]) for i in range(len(offsets))]
    # streaming sends the prompt first
    chunks = [ch.choices[0] for ch in client.completions.create(
        model="tiny", prompt=text, echo=True, logprobs=1, max_tokens=3, temperature=0,
        stream=True) if ch.choices]
    assert chunks[0].text == text and chunks[0].logprobs.token_logprobs[0] is None
    assert chunks[0].logprobs.token_logprobs == c.logprobs.token_logprobs
    plain = client.completions.create(model="tiny", prompt=text, max_tokens=3, temperature=0)
    assert "".join(ch.text for ch in chunks) == text + plain.choices[0].text


def test_echo_without_logprobs_and_refusals(client, server):
    import openai
    got = client.completions.create(model="tiny", prompt=["a b", "c d"], echo=True,
                                    max_tokens=2, temperature=0, n=2)
    assert [ch.text[:3] for ch in got.choices] == ["a b", "a b", "c d", "c d"]
    assert all(ch.logprobs is None for ch in got.choices)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="a b", max_tokens=0)
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="a b", suffix="!", max_tokens=2)
    assert err.value.body["param"] == "suffix"
    kv = httpx.get(f"{server}/debug/kv_conservation", timeout=60).json()["worker-0"]
    assert kv["running"] == 0 and kv["waiting"] == 0


def test_a_prefill_decode_pair_refuses_prompt_logprobs(hf):
    from types import SimpleNamespace

    from radixray.engine.executor.prompt_logprobs import no_prompt_logprobs
    from radixray.engine.inputs import Limits, build_requests
    assert no_prompt_logprobs(SimpleNamespace(disaggregation_mode=None)) is None
    why = no_prompt_logprobs(SimpleNamespace(disaggregation_mode="prefill"))
    limits = Limits(hf.config.vocab_size, 1024, 4096, no_prompt_logprobs=why)
    with pytest.raises(ValueError, match="logprob_start_len: .*prefill-decode pair"):
        build_requests(None, [1, 2, 3], asked(start=0), None, limits)
    # the default start needs no prompt logits: taken anywhere
    assert build_requests(None, [1, 2, 3], asked(start=-1), None, limits)[0]
