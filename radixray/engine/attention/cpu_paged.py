"""``cpu_paged``: decode and extend attention in the C++ CPU kernels (radixray.kernels)."""

from __future__ import annotations

import torch

from radixray.engine.attention.torch_backend import TorchAttention
from radixray.engine.executor.forward_batch import ForwardBatch, ForwardMode


class CpuPagedAttention(TorchAttention):
    """Decode reads K/V straight from the paged pool, extend runs over each request's
    contiguous keys/values, both in the C++ kernels (csrc/attention.cpp; extend over bf16
    or fp8 pools on AMX-BF16 tiles where the CPU has them, csrc/attention_amx.cpp)."""

    name = "cpu_paged"

    def __init__(self, req_to_token, kv_pool, scaling):
        super().__init__(req_to_token, kv_pool, scaling)
        if kv_pool.device.type != "cpu":
            raise ValueError(f"attention_backend='cpu_paged' needs device='cpu', got the KV pool on "
                             f"{kv_pool.device}; use attention_backend='torch' or 'auto'")
        from radixray.kernels.cpu_ops import load_extension
        self.ext = load_extension()
        if self.ext is None:
            raise RuntimeError("attention_backend=cpu_paged needs the radixray CPU kernels")
        # bf16 and fp8 pools hold bf16-exact keys and values: with AMX-BF16, extend runs on
        # tiles (queries and probabilities rounded to bf16, fp32 sums and softmax).
        self.extend_on_tiles = (kv_pool.dtype in (torch.bfloat16, torch.float8_e5m2)
                                and bool(self.ext.amx_bf16_supported()))

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode is ForwardMode.DECODE:
            max_len = max(batch.seq_lens)
            batch.attn_metadata["kv_indices"] = self.req_to_token[batch.req_rows, :max_len]
            batch.attn_metadata["seq_lens"] = torch.tensor(batch.seq_lens, dtype=torch.int64)
        else:
            super().init_forward_metadata(batch)

    def _attend(self, q, k, v, plen: int):
        heads, head_dim = q.shape[1], q.shape[2]
        if self.extend_on_tiles and head_dim % 32 == 0 and heads // k.shape[1] <= 32:
            return self.ext.extend_attention_bf16(q, k, v, plen, self.scaling)
        return self.ext.extend_attention(q, k, v, plen, self.scaling)

    def _decode(self, q, layer, batch):
        meta = batch.attn_metadata
        return self.ext.paged_decode_attention(
            q, self.kv_pool.k_buffers[layer], self.kv_pool.v_buffers[layer],
            meta["kv_indices"], meta["seq_lens"], self.scaling)
