"""The C++ extend (prefill) attention against the SDPA reference: prefix, no prefix, GQA, one
new token (dot-product path) and many (transposed-key path), head sizes off a multiple of 8."""

import pytest
import torch

from radixray.kernels.cpu_ops import load_extension


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
