"""kv_cache_dtype="bfloat16": half the pool bytes, fp32 attention over bf16 keys/values.

The fused decode kernel and the pure-torch reference backend read the same bf16
pool, so their greedy tokens agree (a divergence is allowed only at a near-tie,
judged by the reference's own top-2 logprob gap); a radix-cache hit computes the
same tokens as a cold prefill, because new keys/values pass through the pool's
dtype before attention either way.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import rand_ids

from radixray import Engine

PARAMS = {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True,
          "return_logprob": True, "top_logprobs_num": 2}
NEAR_TIE = 1e-3


def _assert_same(ours, ref, label):
    for i, (a, b) in enumerate(zip(ours["output_ids"], ref["output_ids"])):
        if a != b:
            top = ref["output_top_logprobs"][i]
            gap = top[0][1] - top[1][1]
            assert gap < NEAR_TIE, f"{label}: token {i} differs ({a} vs {b}), top-2 gap {gap:.2e}"
            return


def test_bf16_pool_matches_the_reference_backend(tiny_llama_dir):
    prompts = [rand_ids(200, n, seed=n) for n in (4, 23, 57)]
    opts = dict(model=tiny_llama_dir, max_total_tokens=4096, kv_cache_dtype="bfloat16",
                check_kv_conservation=True)
    with Engine(**opts, attention_backend="torch", cpu_kernels=False) as ref_eng:
        assert ref_eng.runner.kv_pool.k_buffers[0].dtype == torch.bfloat16
        refs = ref_eng.generate(input_ids=prompts, sampling_params=PARAMS)
    with Engine(**opts) as eng:
        assert eng.runner.attn_backend.name == "cpu_paged"
        cold = eng.generate(input_ids=prompts, sampling_params=PARAMS)
        warm = eng.generate(input_ids=prompts, sampling_params=PARAMS)
        for i, (c, w, r) in enumerate(zip(cold, warm, refs)):
            assert w["meta_info"]["cached_tokens"] == len(prompts[i]) - 1
            _assert_same(c, r, f"prompt {i} fused vs reference")
            _assert_same(w, c, f"prompt {i} cache hit vs cold")
        eng.check_kv_conservation()


def test_bf16_pool_halves_bytes_per_token(tiny_llama_dir):
    with Engine(model=tiny_llama_dir, max_total_tokens=1024) as fp32_eng:
        fp32_bytes = fp32_eng.runner.bytes_per_token
    with Engine(model=tiny_llama_dir, max_total_tokens=1024, kv_cache_dtype="bfloat16") as bf16_eng:
        assert bf16_eng.runner.bytes_per_token * 2 == fp32_bytes
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        Engine(model=tiny_llama_dir, kv_cache_dtype="fp8")
