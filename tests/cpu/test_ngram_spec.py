"""N-gram speculative decoding (engine/speculative/): greedy output identical to plain decoding
and to Hugging Face, accept length on repetitive text, exact rejection sampling, bad configs."""

from __future__ import annotations

import random

import pytest
import torch
from model_fixtures import assert_greedy_equal, hf_greedy, random_prompts

from radixray.engine.config import EngineConfig
from radixray.engine.speculative.ngram import NgramIndex
from radixray.engine.speculative.verify import accept_greedy, accept_sampled

NEW = 32
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}
# The tiny Llama's greedy continuation of this prompt runs into one-token loops (two runs of
# 30 tokens in its first 96; checked in test_accept_length_on_repetitive_text).
REPETITIVE = [47, 44, 185] * 6


def _engine(model_dir, **kw):
    from radixray import Engine
    return Engine(**{"model": model_dir, "dtype": "float32", "max_total_tokens": 8192,
                     "check_kv_conservation": True, **kw})


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    with _engine(tiny_llama_dir) as eng:
        yield eng


@pytest.fixture(scope="module")
def spec(tiny_llama_dir):
    """Speculation on, with 16-token prefill chunks (the random prompts cross them). Mixing
    off: with it, requests decode one token each as riders of the prefill steps, and 400
    short requests would spend most of their tokens there instead of in verify steps
    (test_tensor_parallel.py runs mixing with speculation)."""
    with _engine(tiny_llama_dir, speculative_algorithm="NGRAM", chunked_prefill_size=16,
                 enable_mixed_chunk=False) as eng:
        yield eng
        eng.check_kv_conservation()


# ---- units --------------------------------------------------------------------------
def test_ngram_index_prefers_longest_then_latest_match_and_copies_through_cycles():
    idx = NgramIndex(1, 4)
    # "5" occurs twice; the occurrence preceded by "1 2" matches the suffix "1 2 5" longer.
    assert idx.propose([1, 2, 5, 7, 3, 5, 8, 1, 2, 5], 2) == [7, 3]
    cyc = NgramIndex(2, 4)
    assert cyc.propose([9, 4, 6, 4, 6], 5) == [4, 6, 4, 6, 4]  # a 2-cycle, continued
    assert cyc.propose([9, 4, 6, 4, 6, 1], 3) == []  # "6 1" never seen
    assert NgramIndex(3, 3).propose([1, 2], 4) == []


def test_accept_greedy_takes_longest_matching_prefix_plus_target():
    assert accept_greedy([5, 6, 9, 1], [5, 6, 7]) == [5, 6, 9]
    assert accept_greedy([4, 0], [5]) == [4]
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]


def test_rejection_sampling_is_exact_against_point_mass_drafts():
    """Committed tokens follow the target's distributions: the first token is drawn from
    row 0 whatever the draft, the second (given the first draft token was accepted) from
    row 1. 6000 draws with a fixed seed, within 0.03 of the exact probabilities."""
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    n, draft = 6000, [1, 3]
    first = torch.zeros(4)
    second = torch.zeros(4)
    for _ in range(n):
        out = accept_sampled(probs, draft, g)
        first[out[0]] += 1
        if out[0] == draft[0]:
            second[out[1]] += 1
    assert torch.allclose(first / n, probs[0], atol=0.03), first / n
    assert torch.allclose(second / second.sum(), probs[1], atol=0.03), second / second.sum()
    # A draft token with zero probability is never accepted.
    zero = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    assert all(accept_sampled(zero, [0], g) == [1] for _ in range(50))


def test_bad_speculative_configs_name_the_field():
    with pytest.raises(ValueError, match="disaggregation_mode"):
        EngineConfig(speculative_algorithm="NGRAM", disaggregation_mode="prefill")
    with pytest.raises(ValueError, match="ep_size"):
        EngineConfig(speculative_algorithm="NGRAM", ep_size=2)
    with pytest.raises(ValueError, match="speculative_ngram_min_match_window_size"):
        EngineConfig(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=5,
                     speculative_ngram_max_match_window_size=2)
    with pytest.raises(ValueError, match="speculative_algorithm"):
        EngineConfig(speculative_algorithm="EAGLE")
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        EngineConfig(speculative_algorithm="NGRAM", speculative_num_draft_tokens=1)


# ---- engine -------------------------------------------------------------------------
def test_greedy_identical_to_plain_decoding_and_hf(tiny_llama_dir, plain, spec):
    """8 prompts, alone and batched: the same tokens with and without speculation, equal to
    transformers' greedy tokens; KV conservation is checked after every step."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompts = random_prompts(hf.config.vocab_size)
    ref = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=GREEDY)]
    batched = spec.generate(input_ids=prompts, sampling_params=GREEDY)
    spec.flush_cache()
    alone = [spec.generate(input_ids=p, sampling_params=GREEDY) for p in prompts]
    assert [o["output_ids"] for o in batched] == ref
    assert [o["output_ids"] for o in alone] == ref
    for i, p in enumerate(prompts):
        tokens, gaps = hf_greedy(hf, p, NEW)
        assert_greedy_equal(ref[i], tokens, gaps, f"prompt {i}")
    assert sum(o["meta_info"].get("spec_verify_ct", 0) for o in batched) > 0


def test_accept_length_on_repetitive_text(plain, spec):
    """A prompt whose greedy continuation loops: same tokens, accept length above 1.5."""
    params = {**GREEDY, "max_new_tokens": 96}
    ref = plain.generate(input_ids=REPETITIVE, sampling_params=params)["output_ids"]
    repeats = sum(a == b for a, b in zip(ref, ref[1:]))
    assert repeats >= len(ref) // 2, ref  # most tokens repeat the one before: repetitive
    before = spec.scheduler.spec_stats.snapshot()
    out = spec.generate(input_ids=REPETITIVE, sampling_params=params)
    assert out["output_ids"] == ref
    meta = out["meta_info"]
    print(f"accept length on repetitive text: {meta['spec_accept_length']:.2f} "
          f"({meta['spec_verify_ct']} verify forwards for {len(ref)} tokens)")
    assert meta["spec_accept_length"] > 1.5
    after = spec.scheduler.spec_stats.snapshot()
    assert after["verify_steps"] > before["verify_steps"]
    from radixray.cluster.metrics import worker_load
    snap = worker_load(spec.snapshot())
    assert snap.spec["accept_length"] > 1.0 and sum(snap.spec["accept_length_hist"]) > 0
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry

    from radixray.cluster.metrics import spec_families

    class Families:
        def collect(self):
            return spec_families(["w0"], snap.spec)

    registry = CollectorRegistry()
    registry.register(Families())
    text = generate_latest(registry).decode()
    assert "radixray:spec_accept_length{" in text and "spec_verify_steps_total" in text
    assert 'spec_accept_length_per_verify_bucket{le="+Inf",worker="w0"}' in text


def test_stops_apply_token_by_token_within_accepted_drafts(plain, spec):
    """A stop string completed by a token inside an accepted draft, or max_new_tokens, ends
    the request at that token, as without speculation."""
    free = plain.generate(input_ids=REPETITIVE, sampling_params=GREEDY)["output_ids"]
    stop = spec.tokenizer.decode(free[2:5])  # completed by the 5th token, mid-draft
    for params in ({**GREEDY, "max_new_tokens": 7}, {**GREEDY, "stop": [stop]}):
        ref = plain.generate(input_ids=REPETITIVE, sampling_params=params)
        out = spec.generate(input_ids=REPETITIVE, sampling_params=params)
        assert out["output_ids"] == ref["output_ids"]
        assert out["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]
        assert len(out["output_ids"]) <= 7 and out["meta_info"]["spec_verify_ct"] > 0


def test_speculation_caps_running_requests_at_48(plain, spec):
    assert spec.runner.max_running_requests == 48
    assert plain.runner.max_running_requests > 48


def test_sampled_requests_run_with_seeds_and_conserve_kv(plain, spec):
    """Sampled requests (seeded, top-k) go through rejection sampling in one batch with
    greedy ones: same seeds, same output when run again alone; the greedy requests of the
    mixed batch get their plain greedy tokens; every request ends with its budget."""
    params = [{"temperature": 0.7, "top_k": 4, "max_new_tokens": 24, "ignore_eos": True,
               "seed": i} for i in range(6)]
    greedy = {**GREEDY, "max_new_tokens": 24}
    ref = plain.generate(input_ids=REPETITIVE, sampling_params=greedy)["output_ids"]
    mixed = spec.generate(input_ids=[REPETITIVE] * 8, sampling_params=params[:3] + [greedy]
                          + params[3:] + [greedy])
    a = mixed[:3] + mixed[4:7]
    assert mixed[3]["output_ids"] == mixed[7]["output_ids"] == ref
    spec.flush_cache()
    b = [spec.generate(input_ids=REPETITIVE, sampling_params=p) for p in params]
    assert [o["output_ids"] for o in a] == [o["output_ids"] for o in b]
    assert all(len(o["output_ids"]) == 24 for o in a)
    assert sum(o["meta_info"].get("spec_verify_ct", 0) for o in a) > 0


@pytest.mark.slow  # 7 s on a loaded 2-vCPU VM: 2 x 400 sampled requests
def test_sampled_output_distributed_as_without_speculation(plain, spec):
    """Per output position, the empirical token distribution over 400 seeded samples
    (temperature 1, top-k 3) with speculation is within total variation 0.15 of the one
    without (the two differ by sampling noise only: about 0.05 at this size)."""
    params = [{"temperature": 1.0, "top_k": 3, "max_new_tokens": 5, "ignore_eos": True,
               "seed": 1000 + i} for i in range(400)]
    runs = {}
    for name, eng in (("plain", plain), ("spec", spec)):
        eng.flush_cache()
        runs[name] = eng.generate(input_ids=[REPETITIVE] * len(params), sampling_params=params)
    assert sum(o["meta_info"].get("spec_verify_ct", 0) for o in runs["spec"]) > 50
    for j in range(1, 5):
        counts = {}
        for name, outs in runs.items():
            for o in outs:
                key = (name, o["output_ids"][j])
                counts[key] = counts.get(key, 0) + 1
        tokens = {t for _, t in counts}
        tv = sum(abs(counts.get(("plain", t), 0) - counts.get(("spec", t), 0))
                 for t in tokens) / (2 * len(params))
        assert tv < 0.15, (j, tv)


def test_retraction_keeps_outputs_and_kv(tiny_llama_dir, plain):
    """A pool too small for the batch: decode retracts (and verify steps fall back to plain
    decode while the pool is short); the same greedy tokens as alone without speculation,
    KV conserved after every step."""
    rng = random.Random(0)
    candidates = [[rng.randrange(1, 357) for _ in range(40)] for _ in range(12)]
    # EOS allowed (admission then forecasts growth instead of reserving all of it), so keep
    # prompts whose greedy output runs the full 120 tokens.
    params = {"temperature": 0.0, "max_new_tokens": 120}
    outs = plain.generate(input_ids=candidates, sampling_params=params)
    picked = [(p, o["output_ids"]) for p, o in zip(candidates, outs)
              if len(o["output_ids"]) == 120][:4]
    assert len(picked) == 4
    prompts, refs = [p for p, _ in picked], [r for _, r in picked]
    with _engine(tiny_llama_dir, speculative_algorithm="NGRAM", max_total_tokens=300,
                 schedule_conservativeness=0.3) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        assert eng.scheduler.stats.num_retracted_reqs > 0
        assert eng.scheduler.spec_stats.verify_steps > 0
        state = eng.check_kv_conservation()
        assert state["running"] == state["waiting"] == 0
    assert [o["output_ids"] for o in outs] == refs
