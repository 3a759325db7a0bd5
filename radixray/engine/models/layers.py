"""Building blocks shared by the decoder models: RMSNorm, rotary embedding, fused linears."""

from __future__ import annotations

import torch
from torch import nn

from radixray.kernels.cpu_ops import CpuKernels


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 (fused kernel when available)."""

    def __init__(self, dim: int, eps: float, kernels: CpuKernels):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual + x, norm(residual + x))`` in one pass."""
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half layout) with a precomputed cos/sin table.

    The inverse frequencies come from transformers' rope initialisers, so every
    rope type a Hugging Face config names (default, llama3, yarn, ...) matches.
    """

    def __init__(self, config, head_dim: int, max_positions: int, dtype: torch.dtype):
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        pos = torch.arange(max_positions, dtype=torch.float)
        freqs = pos[:, None] * inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kernels: CpuKernels) -> torch.Tensor:
        """Rotate ``x`` of shape ``[T, heads, head_dim]`` by each token's position."""
        return kernels.rotary(x, positions, self.cos, self.sin)


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows are split over the tensor-parallel ranks
    (``shard``: a TPShard); each rank looks up the tokens in its rows, zeros for the rest,
    and the sum over the ranks is every token's embedding. One rank: a plain lookup."""

    def __init__(self, shard, hidden_size: int, tp):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shard.local_vocab, hidden_size))
        self.start = shard.vocab_start
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)
