"""Prefill ("extend") attention for one request as blocked matmuls, for CPUs.

torch's CPU ``scaled_dot_product_attention`` ran a 2,048-token causal prefill
at ~14 GFLOP/s on this project's machine (AVX2, 2 threads), about 7x below its
GEMM rate, and a 1-token extend over a 3,000-token cached prefix cost ~4 ms per
layer. Here each block of queries is one batched GEMM against only the keys it
can see (the prefix plus new tokens up to the block's last query), a masked
softmax on the diagonal part, and one GEMM with the values. GQA heads share
their key/value head without copying it. The reference is
``TorchAttention._attend`` (SDPA); tests compare the two.
"""

from __future__ import annotations

import functools

import torch

# Queries per block. Smaller blocks skip more of the causal triangle's masked half but
# launch more GEMMs; 64 was fastest for 512- and 2,048-token prompts on this project's
# CPUs (32-37% below 256 at 512 tokens; docs/benchmarks.md).
QUERY_BLOCK = 64


@functools.lru_cache(maxsize=8)
def _future_mask(block: int) -> torch.Tensor:
    """``[block, block]`` True above the diagonal; its top-left ``[b, b]`` serves a shorter block."""
    return torch.ones(block, block, dtype=torch.bool).triu_(1)


def blocked_extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                             scale: float, block: int = QUERY_BLOCK) -> torch.Tensor:
    """Causal attention of ``n`` new tokens over ``prefix_len`` cached + the new tokens.

    q: [n, h, d]; k, v: [prefix_len + n, kvh, d] (prefix first), h % kvh == 0.
    Query i (absolute position prefix_len + i) sees keys 0 .. prefix_len + i.
    Returns [n, h, d] in q's dtype.
    """
    n, h, d = q.shape
    total, kvh, _ = k.shape
    group = h // kvh
    qg = q.reshape(n, kvh, group, d).permute(1, 2, 0, 3)  # [kvh, g, n, d]
    kc = k.permute(1, 0, 2).contiguous()  # [kvh, L, d]: one copy, then strided GEMM views
    vc = v.permute(1, 0, 2).contiguous()
    out = torch.empty(kvh, group, n, d, dtype=q.dtype)
    for qs in range(0, n, block):
        qe = min(n, qs + block)
        b = qe - qs
        visible = prefix_len + qe
        qb = qg[:, :, qs:qe].reshape(kvh, group * b, d)
        scores = torch.bmm(qb, kc[:, :visible].transpose(1, 2)).mul_(scale)
        if b > 1:
            # The last b visible keys are the block's own tokens: hide the future ones.
            future = _future_mask(block)[:b, :b]
            scores.view(kvh, group, b, visible)[..., visible - b:].masked_fill_(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[:, :, qs:qe] = torch.bmm(probs, vc[:, :visible]).view(kvh, group, b, d)
    return out.permute(2, 0, 1, 3).reshape(n, h, d)
