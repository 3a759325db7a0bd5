"""kv_cache_dtype="bfloat16" / "fp8_e5m2": a half / a quarter of the fp32 pool's bytes,
fp32 attention over the narrow keys/values.

The fused decode kernel and the pure-torch reference backend read the same narrow
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
from radixray.engine.mem_cache.pool import FP8_E5M2_MAX, KVPool
from radixray.kernels.cpu_ops import load_extension

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


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e5m2"])
def test_narrow_pool_matches_the_reference_backend(tiny_llama_dir, kv_dtype):
    prompts = [rand_ids(200, n, seed=n) for n in (4, 23, 57)]
    opts = dict(model=tiny_llama_dir, max_total_tokens=4096, kv_cache_dtype=kv_dtype,
                check_kv_conservation=True)
    with Engine(**opts, attention_backend="torch", cpu_kernels=False) as ref_eng:
        assert ref_eng.runner.kv_pool.k_buffers[0].dtype == {"bfloat16": torch.bfloat16,
                                                             "fp8_e5m2": torch.float8_e5m2}[kv_dtype]
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


def test_narrow_pools_halve_and_quarter_bytes_per_token(tiny_llama_dir):
    with Engine(model=tiny_llama_dir, max_total_tokens=1024) as fp32_eng:
        fp32_bytes = fp32_eng.runner.bytes_per_token
    with Engine(model=tiny_llama_dir, max_total_tokens=1024, kv_cache_dtype="bfloat16") as bf16_eng:
        assert bf16_eng.runner.bytes_per_token * 2 == fp32_bytes
    with Engine(model=tiny_llama_dir, max_total_tokens=1024, kv_cache_dtype="fp8_e5m2") as fp8_eng:
        assert fp8_eng.runner.bytes_per_token * 4 == fp32_bytes
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        Engine(model=tiny_llama_dir, kv_cache_dtype="fp8")


def test_fp8_pool_writes_round_and_saturate():
    pool = KVPool(8, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float8_e5m2)
    k = torch.tensor([[[1.1, -3.0, 1e5, -1e9]], [[0.0, 2.5, 1e-8, 7.0]]])
    pool.write(0, torch.tensor([3, 5]), k, -k)
    got = pool.k_buffers[0][torch.tensor([3, 5])].float()
    assert torch.equal(got, torch.tensor([[[1.0, -3.0, FP8_E5M2_MAX, -FP8_E5M2_MAX]], [[0.0, 2.5, 0.0, 7.0]]]))
    assert torch.equal(pool.v_buffers[0][torch.tensor([3, 5])].float(), -got)


@pytest.mark.skipif(load_extension() is None, reason="C++ CPU kernels not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2])
def test_one_call_kv_write_equals_the_torch_path(dtype):
    """KVPool.write through the C++ store gives the bytes of the cast + index_copy_ path."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(40, 3, 16, generator=g) * torch.logspace(-9, 6, 16)  # tiny to overflowing
    v = torch.randn(40, 3, 16, generator=g)
    k[0, 0, :3] = torch.tensor([float("inf"), -float("inf"), 0.5 + 2 ** -9])  # saturation, a tie
    slots = torch.randperm(60, generator=g)[:40] + 1
    fused = KVPool(64, num_layers=1, num_kv_heads=3, head_dim=16, dtype=dtype, ext=load_extension())
    plain = KVPool(64, num_layers=1, num_kv_heads=3, head_dim=16, dtype=dtype)
    fused.write(0, slots, k, v)
    plain.write(0, slots, k, v)
    for a, b in ((fused.k_buffers[0], plain.k_buffers[0]), (fused.v_buffers[0], plain.v_buffers[0])):
        assert torch.equal(a[slots].view(torch.uint8), b[slots].view(torch.uint8))
    with pytest.raises(RuntimeError, match=r"slots\[1\]=65 outside \[0, 65\)"):
        load_extension().kv_store(fused.k_buffers[0], fused.v_buffers[0], torch.tensor([1, 65]), k[:2], v[:2])


@pytest.mark.skipif(load_extension() is None, reason="C++ CPU kernels not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2])
def test_rounded_write_returns_what_the_pool_holds(dtype):
    """write_rounded (the extend path) stores the torch path's bytes for any fp32 bit pattern
    (random patterns cover denormals, ties, saturation and inf; NaN stays NaN) and returns
    the stored values widened back, as the torch path's cast back would."""
    g = torch.Generator().manual_seed(5)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (300 * 3 * 64,), generator=g, dtype=torch.int64).to(torch.int32)
    k = bits.view(torch.float32).view(300, 3, 64).clone()
    k[0, 0, :4] = torch.tensor([0.0, -0.0, 0.5 + 2 ** -9, FP8_E5M2_MAX * 1.2])
    v = torch.randn(300, 3, 64, generator=g) * torch.logspace(-9, 6, 64)
    slots = torch.randperm(320, generator=g)[:300] + 1
    fused = KVPool(320, num_layers=1, num_kv_heads=3, head_dim=64, dtype=dtype, ext=load_extension())
    plain = KVPool(320, num_layers=1, num_kv_heads=3, head_dim=64, dtype=dtype)
    got = fused.write_rounded(0, slots, k, v, torch.float32)
    want = plain.write_rounded(0, slots, k, v, torch.float32)
    for a, b in ((fused.k_buffers[0], plain.k_buffers[0]), (fused.v_buffers[0], plain.v_buffers[0])):
        a, b = a[slots].float(), b[slots].float()
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    for a, b in zip(got, want):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
