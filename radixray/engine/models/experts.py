"""Mixture-of-experts pieces: the router's top-k choice and the expert computation.

A MoE layer runs in three stages, each replaceable on its own:

1. :class:`TopKRouter` turns hidden states into router logits and picks each token's
   top-k *logical* experts and their weights, exactly as the Hugging Face model of
   the architecture does (softmax in fp32, optional renormalisation, weight dtype).
2. The layer maps logical ids to *physical* slots (the model's ``ExpertMap``,
   identity unless redundant expert copies exist) so a balancer can move or copy experts.
3. An :class:`ExpertDispatcher` computes the weighted sum of the chosen experts for
   each token. :class:`LocalExperts` holds every slot in this process; an
   expert-parallel backend holds a share and exchanges tokens with its peers.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod

import torch
from torch import nn

from radixray.kernels.cpu_ops import CpuKernels


class Gate(nn.Module):
    """A bias-free projection kept in the model dtype whatever the quantization: the router
    (``mlp.gate``, which must pick the same experts as the unquantized model) and the
    one-row shared-expert gate. Not an ``nn.Linear``, so int8 quantization skips it."""

    def __init__(self, out_features: int, in_features: int, kernels: CpuKernels):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.weight)


class TopKRouter(Gate):
    """Router logits ``[T, E]`` -> each token's top-k logical experts.

    ``renormalize``: divide the k chosen probabilities by their sum (Mixtral always;
    Qwen-MoE when ``norm_topk_prob``). ``fp32_weights``: keep the weights in fp32
    (Mixtral) rather than casting them to the logits' dtype (Qwen-MoE); it matters in
    bf16 only, where it is part of matching the reference model.
    """

    def __init__(self, num_experts: int, hidden_size: int, top_k: int, renormalize: bool,
                 fp32_weights: bool, kernels: CpuKernels):
        super().__init__(num_experts, hidden_size, kernels)
        self.top_k = top_k
        self.renormalize = renormalize
        self.fp32_weights = fp32_weights

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k], logical ids [T, k] int64)``, ids in descending probability."""
        logits = self(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.fp32_weights else weights.to(logits.dtype)), ids


class ExpertDispatcher(nn.Module, ABC):
    """Computes the routed experts of one MoE layer for this process's tokens.

    Contract of :meth:`dispatch`: ``hidden`` ``[T, H]``, ``topk_ids`` ``[T, k]`` int64
    *physical* slots (``0 <= id < num_physical``), ``topk_weights`` ``[T, k]``; returns
    ``[T, H]`` in ``hidden``'s dtype with row ``t`` equal to
    ``sum_j topk_weights[t, j] * expert[topk_ids[t, j]](hidden[t])``, where an expert is
    SwiGLU ``down(silu(gate(x)) * up(x))``. Each product is rounded to ``hidden``'s
    dtype and the k of a token are added in increasing slot order (what transformers
    does, so results match it bit for bit where the matmuls do). ``T`` may be 0: an
    expert-parallel backend must still join its collectives then, so every rank of
    its group calls ``dispatch`` once per MoE layer per forward pass.

    Parameters are named as transformers names them in memory: ``gate_up_proj``
    ``[slots, 2 * inter, H]`` (gate rows first) and ``down_proj`` ``[slots, H, inter]``,
    so checkpoints load through ``stacked_shards`` (see ``engine/weights/layout.py``). Every
    parameter is stacked over the slots this process holds (dim 0, in slot order):
    moving experts between slots (EPLB) copies along that dimension.
    """

    num_physical: int

    @abstractmethod
    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        ...


class LocalExperts(ExpertDispatcher):
    """Every expert slot in this process: tokens grouped by slot (one sort), then one
    gate|up and one down matmul per slot that has tokens. Plain torch ops through the
    engine's kernels (the small-M linear; batch-invariant in deterministic mode). On CUDA
    with triton installed, the fused MoE kernel instead (radixray/kernels/triton_moe.py:
    one grouped GEMM per projection for all slots; each token's k products are summed in
    fp32 and rounded once, not added one by one)."""

    def __init__(self, num_slots: int, hidden_size: int, intermediate_size: int,
                 kernels: CpuKernels):
        super().__init__()
        self.num_physical = num_slots
        self.inter = intermediate_size
        self.kernels = kernels
        self.gate_up_proj = nn.Parameter(torch.empty(num_slots, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_slots, hidden_size, intermediate_size))

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        if hidden.is_cuda and _triton_installed():
            from radixray.kernels.triton_moe import fused_moe
            return fused_moe(hidden, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)
        out = torch.zeros_like(hidden)
        if hidden.shape[0] == 0:
            return out
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order // k
        weights = topk_weights.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=self.num_physical).tolist()
        start = 0
        for slot, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start:start + n]
            x = hidden[rows]
            h = self.kernels.silu_mul(self.kernels.linear(x, self.gate_up_proj[slot]))
            y = self.kernels.linear(h, self.down_proj[slot]) * weights[start:start + n, None]
            out.index_add_(0, rows, y.to(out.dtype))
            start += n
        return out


@functools.cache
def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
