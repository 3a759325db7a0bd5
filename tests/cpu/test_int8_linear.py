"""W8A8 int8 linears: the GEMM path against its fp64 reference, and the engine against a
Hugging Face model whose linears run the same quantized arithmetic."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import hf_greedy
from torch import nn

from radixray import Engine
from radixray.engine.config import EngineConfig
from radixray.kernels.cpu_ops import CpuKernels, load_extension, silu_mul_ref
from radixray.kernels.int8_linear import (
    Int8Linear,
    Int8ReferenceLinear,
    int8_gated_mlp,
    int8_linear_ref,
    quantize_linears,
    quantize_per_channel,
    quantize_per_token,
    replace_linears,
    rescale_ref,
)

needs_ext = pytest.mark.skipif(load_extension() is None, reason="C++ CPU kernels not built here")


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("m,k,n", [(1, 64, 96), (7, 576, 1536), (33, 1536, 576), (300, 100, 41)])
def test_int8_linear_matches_reference(m, k, n, fused):
    torch.manual_seed(m)
    w, b, x = torch.randn(n, k) * 0.05, torch.randn(n), torch.randn(m, k)
    x[0, 3] = 40.0  # an outlier channel only affects its own token's scale
    layer = Int8Linear(w, b, fused_ops=fused)
    ref = int8_linear_ref(x, layer.w_q, layer.w_scale, b)
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-4)
    # rows without the outlier stay close to the unquantized product
    exact = (x @ w.t() + b)[1:]
    if m > 1:
        assert (layer(x)[1:] - exact).abs().max() < 0.05 * exact.abs().max()


@needs_ext
@pytest.mark.parametrize("m,k", [(1, 576), (5, 37), (70, 1536), (3, 8)])
def test_cpp_quantize_and_rescale_match_torch(m, k):
    ext = load_extension()
    torch.manual_seed(k)
    x = torch.randn(m, k) * torch.logspace(-3, 2, m)[:, None]
    x[0, :4] = torch.tensor([0.5, -0.5, 1.5, 127.0]) * (x[0].abs().max() / 127)  # exact .5 ties
    q, s = ext.quantize_rows_int8(x)
    q_ref, s_ref = quantize_per_token(x)
    assert torch.equal(s, s_ref) and torch.equal(q, q_ref)
    n = 19
    acc = torch.randint(-2**20, 2**20, (m, n), dtype=torch.int32)
    ws, bias = torch.rand(n), torch.randn(n)
    for b in (bias, None):
        torch.testing.assert_close(ext.rescale_int8_acc(acc, s, ws, b), rescale_ref(acc, s, ws, b),
                                   rtol=1e-6, atol=1e-6)


@needs_ext
@pytest.mark.parametrize("m,k,inter,bias", [(1, 64, 96, False), (37, 576, 1536, False), (5, 40, 21, True)])
def test_fused_gated_mlp_equals_the_three_steps(m, k, inter, bias):
    """rescale -> silu-mul -> quantize in one pass gives the codes of the separate C++ ops,
    and the MLP output stays within rounding of the torch-reference chain."""
    ext = load_extension()
    torch.manual_seed(m + inter)
    x = torch.randn(m, k)
    gate_up = Int8Linear(torch.randn(2 * inter, k) * 0.1, torch.randn(2 * inter) if bias else None)
    down = Int8Linear(torch.randn(k, inter) * 0.1, torch.randn(k) if bias else None)
    x_q, x_scale = ext.quantize_rows_int8(x)
    acc = gate_up.accumulate(x_q)
    h_q, h_scale = ext.rescale_silu_mul_quantize(acc, x_scale, gate_up.w_scale, gate_up.bias)
    want_q, want_scale = ext.quantize_rows_int8(ext.silu_mul(gate_up(x)))
    assert torch.equal(h_q, want_q) and torch.equal(h_scale, want_scale)
    fused = int8_gated_mlp(x, gate_up, down)
    torch.testing.assert_close(fused, down(ext.silu_mul(gate_up(x))), rtol=0, atol=0)
    # the torch reference chain (torch exp, torch quantizer) agrees to within a code or two
    h_ref_q, h_ref_scale = quantize_per_token(silu_mul_ref(rescale_ref(acc, x_scale, gate_up.w_scale, gate_up.bias)))
    assert (h_ref_q.int() - h_q.int()).abs().max() <= 1
    torch.testing.assert_close(h_ref_scale, h_scale, rtol=1e-5, atol=0)
    # and the dispatch picks the fused form only for an all-int8 pair
    kernels = CpuKernels(enabled=True)
    assert torch.equal(kernels.gated_mlp(x, gate_up, down), fused)
    plain_down = nn.Linear(inter, k, bias=bias)
    assert gate_up.fused_gated_mlp(x, plain_down) is None
    torch.testing.assert_close(kernels.gated_mlp(x, gate_up, plain_down),
                               plain_down(ext.silu_mul(gate_up(x))), rtol=1e-5, atol=1e-5)


@needs_ext
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("k,n", [(576, 960), (70, 33), (1536, 7)])
def test_small_m_int8_gemm_gives_the_same_integers(m, k, n):
    ext = load_extension()
    g = torch.Generator().manual_seed(m * k + n)
    x = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    x[0, :32] = 127
    w[0, :32] = -127  # the largest products: maddubs pairs must not saturate
    assert torch.equal(ext.int8_gemm_small_m(x, w), x.int() @ w.int().t())


@needs_ext
def test_small_m_int8_gemm_bounds_and_dispatch():
    ext = load_extension()
    w = torch.randint(-127, 128, (16, 32), dtype=torch.int8)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        ext.int8_gemm_small_m(torch.zeros(9, 32, dtype=torch.int8), w)
    layer = Int8Linear(torch.randn(40, 64), None)
    for rows in (1, 4, 5, 33):  # C++ kernel up to SMALL_M_MAX rows, torch._int_mm above
        x_q = torch.randint(-127, 128, (rows, 64), dtype=torch.int8)
        assert torch.equal(layer.accumulate(x_q), x_q.int() @ layer.w_q.int().t())


def test_quantizers_bound_the_error():
    torch.manual_seed(0)
    w = torch.randn(16, 32)
    w[3] = 0.0  # a zero row must not divide by zero
    q, s = quantize_per_channel(w)
    assert q.dtype == torch.int8 and s.shape == (16,) and s[3] == 1.0
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-7).all()
    x = torch.randn(5, 32)
    xq, xs = quantize_per_token(x)
    assert ((xq.float() * xs[:, None] - x).abs() <= xs[:, None] / 2 + 1e-6).all()
    assert int(xq.abs().max()) == 127


def test_rows_do_not_depend_on_the_rest_of_the_batch():
    torch.manual_seed(1)
    layer = Int8Linear(torch.randn(64, 48), None)
    x = torch.randn(9, 48)
    x[4] *= 100  # a loud neighbour
    full = layer(x)
    for i in range(9):
        assert torch.equal(full[i], layer(x[i:i + 1])[0])


def test_quantize_linears_keeps_lm_head_and_counts():
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(8, 8))
    model.add_module("lm_head", nn.Linear(8, 4, bias=False))
    assert quantize_linears(model, None) == 0 and isinstance(model.proj, nn.Linear)
    assert quantize_linears(model, "w8a8_int8") == 1
    assert isinstance(model.proj, Int8Linear) and isinstance(model.lm_head, nn.Linear)
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_linears(model, "fp4")


def test_config_names_the_field():
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(quantization="w8a8_int8", device="cuda")
    with pytest.raises(ValueError, match="quantize_lm_head needs quantization='w8a8_int8'"):
        EngineConfig(quantize_lm_head=True)
    from radixray.cluster.config import ConfigError, ServeConfig
    with pytest.raises(ConfigError, match="engine: .*quantize_lm_head needs quantization=.w8a8_int8."):
        ServeConfig.parse({"engine": {"quantize_lm_head": True}})
    assert ServeConfig.parse({"engine": {"quantization": "w8a8_int8", "quantize_lm_head": True}}) \
        .engine.engine_options()["quantize_lm_head"] is True


QUANT_NEAR_TIE = 1e-3  # a last-bit difference before a rounding step can move one int8 code


@pytest.mark.parametrize("kind,lm_head", [("llama", False), ("qwen2", False), ("llama", True)])
def test_engine_matches_hf_with_the_same_quantization(kind, lm_head, request):
    from transformers import AutoModelForCausalLM
    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    replace_linears(hf, Int8ReferenceLinear, skip=() if lm_head else ("lm_head",))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 19, 40)]
    greedy = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    with Engine(model=model_dir, dtype="float32", quantization="w8a8_int8", quantize_lm_head=lm_head,
                max_total_tokens=4096, check_kv_conservation=True) as eng:
        assert eng.runner.quantized_layers == 4 * hf.config.num_hidden_layers + lm_head
        assert (eng.runner.model.lm_head_int8 is not None) == lm_head
        outs = eng.generate(input_ids=prompts, sampling_params=greedy)
        eng.check_kv_conservation()
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref, gaps = hf_greedy(hf, p, 24)
        for step, (a, b) in enumerate(zip(out["output_ids"], ref)):
            if a != b:
                assert gaps[step] < QUANT_NEAR_TIE, (
                    f"{kind} prompt {i}: token {step} ours {a} vs reference {b} (gap {gaps[step]:.2e})")
                break
