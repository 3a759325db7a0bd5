"""The C++ extend (prefill) attention against the SDPA reference: prefix, no prefix, GQA, one
new token (dot-product path) and many (transposed-key path), head sizes off a multiple of 8;
and the AMX-BF16 kernel (bf16 and fp8 pools) against its bf16-rounding reference."""

import pytest
import torch

from radixray.kernels.cpu_ops import extend_attention_bf16_ref, load_extension

EXT = load_extension()
HAS_AMX_BF16 = EXT is not None and bool(EXT.amx_bf16_supported())
needs_amx_bf16 = pytest.mark.skipif(not HAS_AMX_BF16, reason="no AMX-BF16 (or no C++ kernels) here")


def sdpa_reference(q, k, v, plen, scale):
    n = q.shape[0]
    mask = torch.ones(n, plen + n, dtype=torch.bool).tril(diagonal=plen)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
        enable_gqa=True)
    return out.transpose(0, 1)


@pytest.mark.skipif(load_extension() is None, reason="C++ CPU kernels not built here")
@pytest.mark.parametrize("n,plen,h,kvh,d", [
    (1, 0, 4, 2, 32), (1, 300, 9, 3, 64), (7, 0, 4, 4, 16), (70, 33, 9, 3, 64), (300, 0, 12, 1, 32),
    (513, 1000, 8, 2, 128), (150, 20, 6, 2, 70), (37, 5, 16, 2, 64),
])
def test_cpp_kernel_matches_sdpa(n, plen, h, kvh, d):
    g = torch.Generator().manual_seed(n + plen + d)
    q = torch.randn(n, h, d, generator=g)
    k = torch.randn(plen + n, kvh, d, generator=g)
    v = torch.randn(plen + n, kvh, d, generator=g)
    k[plen // 2] *= 30  # a few large scores: each row's softmax subtracts its own max
    got = load_extension().extend_attention(q, k, v, plen, d ** -0.5)
    want = sdpa_reference(q, k, v, plen, d ** -0.5)
    assert got.shape == (n, h, d)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_cpp_kernel_rejects_mismatched_shapes():
    ext = load_extension()
    if ext is None:
        pytest.skip("C++ CPU kernels not built here")
    q, kv = torch.randn(4, 4, 16), torch.randn(6, 2, 16)
    with pytest.raises(RuntimeError, match="prefix_len \\+ n"):
        ext.extend_attention(q, kv, kv, 1, 0.25)  # 1 + 4 != 6


@needs_amx_bf16
@pytest.mark.parametrize("n,plen,h,kvh,d,pool", [
    (1, 0, 4, 2, 32, torch.bfloat16), (1, 300, 9, 3, 64, torch.float8_e5m2), (7, 0, 4, 4, 64, torch.bfloat16),
    (70, 33, 9, 3, 64, torch.float8_e5m2), (300, 0, 12, 1, 32, torch.bfloat16),
    (513, 1000, 8, 2, 128, torch.bfloat16), (37, 5, 16, 2, 64, torch.float8_e5m2), (16, 16, 32, 1, 32, torch.bfloat16),
])
def test_amx_bf16_kernel_matches_its_reference_and_sdpa(n, plen, h, kvh, d, pool):
    """Keys and values rounded through the pool's dtype, as the engine passes them; the kernel
    equals the bf16-rounding reference up to fp32 summation order (and an occasional
    probability one bf16 step apart), and stays near fp32 SDPA."""
    g = torch.Generator().manual_seed(n + plen + d)
    q = torch.randn(n, h, d, generator=g)
    k = torch.randn(plen + n, kvh, d, generator=g)
    v = torch.randn(plen + n, kvh, d, generator=g)
    k[plen // 2] *= 30
    k, v = k.to(pool).float(), v.to(pool).float()
    got = EXT.extend_attention_bf16(q, k, v, plen, d ** -0.5)
    assert got.shape == (n, h, d)
    torch.testing.assert_close(got, extend_attention_bf16_ref(q, k, v, plen, d ** -0.5), rtol=0, atol=2e-3)
    # Against fp32: the queries' bf16 rounding moves each score by up to ~2^-9 of its size
    # (more where the 30x key makes scores large), so near on average, looser at worst.
    err = (got - sdpa_reference(q, k, v, plen, d ** -0.5)).abs()
    assert err.mean() < 3e-3 and err.max() < 0.15


@needs_amx_bf16
def test_amx_bf16_kernel_names_what_it_cannot_take():
    with pytest.raises(RuntimeError, match="multiple of 32, got 48"):
        EXT.extend_attention_bf16(torch.randn(2, 2, 48), torch.randn(2, 1, 48), torch.randn(2, 1, 48), 0, 0.1)
    with pytest.raises(RuntimeError, match="prefix_len \\+ n"):
        EXT.extend_attention_bf16(torch.randn(4, 4, 32), torch.randn(6, 2, 32), torch.randn(6, 2, 32), 1, 0.1)
