"""The int8 GEMM on packed weights (csrc/int8_vnni.cpp: AVX-512 VNNI, and AMX tiles where
the CPU has them, csrc/int8_amx.h) against an int32 matmul, its packed layout, and where
``Int8Linear`` uses it. Skipped on CPUs without VNNI; the AMX cases without AMX."""

from __future__ import annotations

import pytest
import torch

from radixray.kernels.cpu_ops import load_extension
from radixray.kernels.int8_linear import (
    VNNI_M_MAX,
    Int8Linear,
    amx_available,
    unpack_vnni,
    vnni_available,
)

EXT = load_extension()
needs_vnni = pytest.mark.skipif(not vnni_available(EXT), reason="no AVX-512 VNNI (or no C++ kernels) here")
HAS_AMX = amx_available(EXT)


@pytest.fixture(params=["vnni", "amx"])
def packed_kernel(request):
    """Runs the test with the packed GEMM forced onto one instruction set: AMX from the first
    row (skipped where the CPU has no AMX) or VNNI for every row count."""
    if request.param == "amx" and not HAS_AMX:
        pytest.skip("no AMX-INT8 here")
    old = EXT.int8_set_amx_min_rows(1 if request.param == "amx" else 1 << 40)
    yield request.param
    EXT.int8_set_amx_min_rows(old)


def _codes(shape, seed):
    return torch.randint(-127, 128, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


@needs_vnni
@pytest.mark.parametrize("m", [1, 2, 4, 5, 8, 9, 17, 33, 100])
@pytest.mark.parametrize("k,n", [(5, 17), (70, 40), (576, 960), (1536, 576), (64, 49), (128, 16)])
def test_vnni_gemm_gives_the_same_integers(m, k, n, packed_kernel):
    """Both kernels; with AMX, K not a multiple of 64 (5, 70) stays on VNNI, and N covers
    an odd block count with a partial last block (49) and a single block (16)."""
    x, w = _codes((m, k), m * 1000 + k), _codes((n, k), n * 7 + k)
    x[0], w[0] = 127, 127  # the largest sums, both signs, and the smallest code
    x[-1], w[-1] = -127, 127
    x[-1, 0] = -128
    packed, comp = EXT.int8_vnni_pack(w)
    assert torch.equal(EXT.int8_vnni_gemm(x, packed, comp, n), x.int() @ w.int().t())


@needs_vnni
def test_vnni_pack_layout_round_trips_and_checks_shapes():
    w = _codes((37, 70), 3)  # neither N a multiple of 16 nor K of 4: both padded
    packed, comp = EXT.int8_vnni_pack(w)
    assert packed.shape == (3, 72 * 16) and comp.shape == (48,)
    assert torch.equal(unpack_vnni(packed, 37, 70), w)
    assert torch.equal(comp[:37], 128 * w.int().sum(1)) and not comp[37:].any()
    with pytest.raises(RuntimeError, match="does not match x's K = 64"):
        EXT.int8_vnni_gemm(_codes((2, 64), 4), packed, comp, 37)
    assert EXT.int8_vnni_gemm(_codes((0, 70), 5), packed, comp, 37).shape == (0, 37)


@needs_vnni
def test_int8_linear_uses_the_packed_gemm_up_to_its_bound_and_int_mm_above():
    """Without AMX the packed (VNNI) GEMM runs up to VNNI_M_MAX rows; with AMX, for every row count."""
    layer = Int8Linear(torch.randn(40, 64), None)
    assert layer.vnni and torch.equal(unpack_vnni(layer.w_vnni, 40, 64), layer.w_q)
    calls = []
    real = EXT.int8_vnni_gemm

    class Spy:
        def __getattr__(self, name):
            return getattr(EXT, name)

        def int8_vnni_gemm(self, *args):
            calls.append(args[0].shape[0])
            return real(*args)

    layer.ext = Spy()
    for rows in (1, 33, VNNI_M_MAX, VNNI_M_MAX + 1):
        x_q = _codes((rows, 64), rows)
        assert torch.equal(layer.accumulate(x_q), x_q.int() @ layer.w_q.int().t())
    assert calls == [1, 33, VNNI_M_MAX] + ([VNNI_M_MAX + 1] if layer.amx else [])


def test_vnni_and_amx_support_are_plain_answers():
    assert vnni_available(None) is False and amx_available(None) is False
    if EXT is not None:
        assert isinstance(EXT.int8_vnni_supported(), bool)
        assert isinstance(EXT.int8_amx_supported(), bool)


@needs_vnni
@pytest.mark.parametrize("m,k,n,bias", [(1, 576, 960, False), (5, 70, 49, True), (33, 1536, 576, True),
                                         (8, 64, 16, False), (70, 128, 80, True)])
def test_vnni_linear_equals_the_separate_ops(m, k, n, bias, packed_kernel):
    """quantize -> GEMM -> rescale in one call gives the bits of the three ops, from fp32
    rows or from codes and their scales."""
    g = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=g) * 3
    w_q, w_scale = _codes((n, k), n), torch.rand(n, generator=g) * 0.01
    b = torch.randn(n, generator=g) if bias else None
    packed, comp = EXT.int8_vnni_pack(w_q)
    x_q, x_scale = EXT.quantize_rows_int8(x)
    want = EXT.rescale_int8_acc(EXT.int8_vnni_gemm(x_q, packed, comp, n), x_scale, w_scale, b)
    assert torch.equal(EXT.int8_vnni_linear(x, None, packed, comp, w_scale, b, n), want)
    assert torch.equal(EXT.int8_vnni_linear(x_q, x_scale, packed, comp, w_scale, b, n), want)


@needs_vnni
@pytest.mark.parametrize("m", [1, 37, 128, 300, 520])
@pytest.mark.parametrize("k,inter,bias", [(576, 1536, False), (128, 48, True), (70, 48, False), (64, 21, True)])
def test_gated_codes_equal_the_three_steps(m, k, inter, bias, packed_kernel):
    """int8_vnni_gated_codes gives the codes and scales of quantize -> packed GEMM ->
    rescale_silu_mul_quantize. With AMX, 128 rows and up (several 32-row blocks per thread
    on up to 8 threads at 520) take the fused tile kernel, fewer rows, K not a multiple of 64
    (70) or a half width not a multiple of 16 (21) the three steps."""
    torch.manual_seed(m + k + inter)
    x = torch.randn(m, k) * 3
    x[0] = 0.0  # an all-zero row: the smallest scale
    w = torch.randn(2 * inter, k) * 0.1
    layer = Int8Linear(w, torch.randn(2 * inter) if bias else None)
    x_q, x_scale = EXT.quantize_rows_int8(x)
    acc = EXT.int8_vnni_gemm(x_q, layer.w_vnni, layer.w_vnni_comp, 2 * inter)
    want_q, want_s = EXT.rescale_silu_mul_quantize(acc, x_scale, layer.w_scale, layer.bias)
    got_q, got_s = EXT.int8_vnni_gated_codes(x, layer.w_vnni, layer.w_vnni_comp, layer.w_scale, layer.bias, 2 * inter)
    assert torch.equal(got_q, want_q) and torch.equal(got_s, want_s)


@needs_vnni
def test_gated_codes_name_what_is_wrong():
    layer = Int8Linear(torch.randn(96, 64), None)
    with pytest.raises(RuntimeError, match="x must be 2-D float32"):
        EXT.int8_vnni_gated_codes(torch.zeros(4, 64, dtype=torch.int8), layer.w_vnni, layer.w_vnni_comp,
                                  layer.w_scale, None, 96)
    with pytest.raises(RuntimeError, match="must be even"):
        EXT.int8_vnni_gated_codes(torch.zeros(4, 64), layer.w_vnni, layer.w_vnni_comp, layer.w_scale, None, 95)
    with pytest.raises(RuntimeError, match="w_scale must be float32"):
        EXT.int8_vnni_gated_codes(torch.zeros(4, 64), layer.w_vnni, layer.w_vnni_comp, layer.w_scale[:10], None, 96)


@needs_vnni
def test_vnni_linear_names_what_is_wrong():
    packed, comp = EXT.int8_vnni_pack(_codes((16, 32), 1))
    w_scale = torch.ones(16)
    with pytest.raises(RuntimeError, match="x_scale goes with int8 x"):
        EXT.int8_vnni_linear(torch.randn(2, 32), torch.ones(2), packed, comp, w_scale, None, 16)
    with pytest.raises(RuntimeError, match="w_scale must be float32"):
        EXT.int8_vnni_linear(torch.randn(2, 32), None, packed, comp, torch.ones(15), None, 16)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        EXT.int8_vnni_linear(torch.randn(2, 32), None, packed, comp, w_scale, torch.ones(16).double(), 16)
