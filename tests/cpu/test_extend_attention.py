"""The blocked extend attention against the SDPA reference (prefix, no prefix, GQA, 1 token)."""

import pytest
import torch

from radixray.kernels.extend_attention import blocked_extend_attention


def sdpa_reference(q, k, v, plen, scale):
    n = q.shape[0]
    mask = torch.ones(n, plen + n, dtype=torch.bool).tril(diagonal=plen)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
        enable_gqa=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("n,plen,h,kvh,block", [
    (1, 0, 4, 2, 256), (1, 300, 9, 3, 256), (7, 0, 4, 4, 3), (70, 33, 9, 3, 16),
    (300, 0, 4, 2, 256), (513, 1000, 8, 2, 256), (150, 20, 9, 3, 64),
])
def test_blocked_matches_sdpa(n, plen, h, kvh, block):
    g = torch.Generator().manual_seed(n + plen)
    d = 32
    q = torch.randn(n, h, d, generator=g)
    k = torch.randn(plen + n, kvh, d, generator=g)
    v = torch.randn(plen + n, kvh, d, generator=g)
    got = blocked_extend_attention(q, k, v, plen, d ** -0.5, block=block)
    want = sdpa_reference(q, k, v, plen, d ** -0.5)
    assert got.shape == (n, h, d)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
