"""``cpu_batch_invariant``: the attention of deterministic mode.

A token's attention output is the same bits whether it is decoded alone, decoded in a
batch, or prefilled in a chunk of any size after a prefix of any length (cached or
just computed). The C++ kernels already compute each (query row, head) on its own:
scores as 8-lane dot products in token order, a softmax whose padding lanes add exact
zeros, values summed in token order; two things remain batch-dependent and are pinned
here:

- extend switches its score pass to a transposed-key GEMM (another summation order) at
  ``TRANSPOSE_MIN_TOKENS`` new tokens, so new tokens go to it in slices one shorter;
- the AVX-512 decode kernel sums in 16 lanes where extend sums in 8, so it is turned off
  (process-wide: decode on this process then runs the AVX2 kernel).
"""

from __future__ import annotations

import torch

from radixray.engine.attention.cpu_paged import CpuPagedAttention

TRANSPOSE_MIN_TOKENS = 16  # kTransposeMinTokens in csrc/attention.cpp


class BatchInvariantAttention(CpuPagedAttention):
    """:class:`CpuPagedAttention` with the two pins of the module docstring; fp32 pools only."""

    name = "cpu_batch_invariant"

    def __init__(self, req_to_token, kv_pool, scaling):
        super().__init__(req_to_token, kv_pool, scaling)
        if kv_pool.dtype != torch.float32:
            raise ValueError(f"deterministic attention needs a float32 KV pool, got {kv_pool.dtype}; "
                             f"use kv_cache_dtype='auto' with dtype float32")
        self.ext.set_decode_avx512(False)

    def _attend(self, q, k, v, plen: int):
        n, step = q.shape[0], TRANSPOSE_MIN_TOKENS - 1
        if n <= step:
            return self.ext.extend_attention(q, k, v, plen, self.scaling)
        # Slice s sees the prefix and the new tokens before it, as a later chunk would.
        return torch.cat([
            self.ext.extend_attention(q[s:s + step], k[:plen + min(n, s + step)],
                                      v[:plen + min(n, s + step)], plen + s, self.scaling)
            for s in range(0, n, step)])
