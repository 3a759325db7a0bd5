"""Plain-torch reference for the fused mixture-of-experts kernel (``triton_moe.fused_moe``).

The contract is the engine's ``ExpertDispatcher.dispatch`` (engine/models/experts.py):
``hidden`` ``[T, H]``, ``topk_ids`` ``[T, k]`` int64 expert slots (``0 <= id < E``),
``topk_weights`` ``[T, k]``; ``gate_up_proj`` ``[E, 2 * I, H]`` (gate rows first, then up
rows) and ``down_proj`` ``[E, H, I]``, both stored out x in like ``nn.Linear.weight``.
The result is ``[T, H]`` in ``hidden``'s dtype, row ``t`` being

    sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = topk_ids[t, j].

This module must not import triton: it is what the kernel is checked against on machines
without it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_moe_ref(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  block_m: int | None = None) -> torch.Tensor:
    """The MoE contract above, computed one expert at a time entirely in fp32 and cast to
    ``hidden``'s dtype once at the end (so it is the more exact side of any comparison).

    ``block_m`` is accepted for signature parity with ``fused_moe`` and ignored. The k
    contributions of a token are accumulated by ``index_add_`` in increasing expert order.
    """
    del block_m  # no tiling here
    num_tokens, hidden_size = hidden.shape
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    if num_tokens == 0:
        return out.to(hidden.dtype)
    num_experts = gate_up_proj.shape[0]
    inter = down_proj.shape[2]
    k = topk_ids.shape[1]

    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)          # (token, j) pairs grouped by expert
    tokens = order // k
    weights = topk_weights.reshape(-1)[order].float()
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    x_all = hidden.float()
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        gate_up = x_all[rows] @ gate_up_proj[expert].float().t()       # [n, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]          # [n, I]
        y = act @ down_proj[expert].float().t()                        # [n, H]
        out.index_add_(0, rows, y * weights[start:start + n, None])
        start += n
    return out.to(hidden.dtype)
