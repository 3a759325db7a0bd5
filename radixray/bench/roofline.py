"""Machine ceilings measured in the same run as a benchmark: memory bandwidth and GEMM rate.

The floors derived from them: a decode step cannot beat (bytes it must read) /
bandwidth, nor (FLOPs it must do) / GEMM rate.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from radixray.kernels.int8_linear import Int8Linear


def _median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_read_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 7) -> float:
    """Bytes per second of a streaming read (a sum over a buffer far larger than the caches)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / _median_seconds(lambda: buf.sum(), repeats)


def measure_gemm_flops(n: int = 2048, dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    """FLOP/s of a large square matmul in ``dtype`` (int8: ``torch._int_mm``, int32 accumulation)."""
    if dtype == torch.int8:
        a = torch.randint(-127, 128, (n, n), dtype=torch.int8)
        b = torch.randint(-127, 128, (n, n), dtype=torch.int8).t()
        return 2 * n**3 / _median_seconds(lambda: torch._int_mm(a, b), repeats)
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _median_seconds(lambda: a @ b, repeats)


@dataclass
class ModelCost:
    """Bytes and FLOPs of one forward pass of a dense decoder."""

    weight_bytes: int  # every matmul weight read once per step (embedding rows excluded unless tied)
    matmul_params: int  # multiply-adds per token in the linear layers (incl. lm_head)
    kv_bytes_per_token: int
    attn_flops_per_ctx_token: int  # FLOPs per (new token x context token): QK^T and PV over all layers

    @classmethod
    def of(cls, model, kv_bytes_per_token: int) -> ModelCost:
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        matmul = 0
        nbytes = 0
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed_tokens" not in name:
                matmul += p.numel()
                nbytes += p.numel() * p.element_size()
        for mod in model.modules():  # quantized layers keep their int8 weights as buffers
            if isinstance(mod, Int8Linear):  # one byte a weight, read once whichever layout runs
                matmul += mod.in_features * mod.out_features
                nbytes += mod.in_features * mod.out_features
        head = model.lm_head_weight
        int8_head = getattr(model, "lm_head_int8", None) is not None  # counted above
        if model.tie_word_embeddings and not int8_head:
            matmul += head.numel()
            nbytes += head.numel() * head.element_size()
        elif not model.tie_word_embeddings and int8_head:  # the fp32 head weight is not read
            matmul -= head.numel()
            nbytes -= head.numel() * head.element_size()
        attn = 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim
        return cls(nbytes, matmul, kv_bytes_per_token, attn)

    def decode_step_floor(self, batch: int, ctx: int, bandwidth: float, flops: float) -> float:
        """Seconds: the larger of the bandwidth floor and the compute floor of one decode step."""
        read = self.weight_bytes + batch * ctx * self.kv_bytes_per_token
        work = batch * (2 * self.matmul_params + ctx * self.attn_flops_per_ctx_token)
        return max(read / bandwidth, work / flops)

    def prefill_floor(self, tokens: int, prompt_len: int, flops: float) -> float:
        """Seconds of compute to prefill ``tokens`` tokens in prompts of ``prompt_len``."""
        avg_ctx = (prompt_len + 1) / 2
        return tokens * (2 * self.matmul_params + avg_ctx * self.attn_flops_per_ctx_token) / flops
