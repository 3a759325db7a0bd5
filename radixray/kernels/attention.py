"""Paged-KV attention backends behind one interface, chosen by name at start-up.

``torch`` is the reference implementation and runs anywhere. GPU backends
(flashinfer, triton) register under their own names and import their libraries
only when created, so importing this module never needs a GPU.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixray.engine.forward_batch import ForwardBatch, ForwardMode
from radixray.engine.memory import KVPool


class AttentionBackend(abc.ABC):
    """Computes attention for one layer of a packed batch over a paged KV pool.

    Contract: ``init_forward_metadata`` runs once per step before the first layer
    and may store per-step index tensors in ``batch.attn_metadata``. ``forward``
    writes the new keys/values of layer ``layer`` to ``batch.out_cache_loc`` and
    returns the attention output ``[T, num_heads, head_dim]``.
    """

    name: str

    def __init__(self, req_to_token: torch.Tensor, kv_pool: KVPool, scaling: float):
        self.req_to_token = req_to_token
        self.kv_pool = kv_pool
        self.scaling = scaling

    @abc.abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                batch: ForwardBatch) -> torch.Tensor: ...


class TorchAttention(AttentionBackend):
    """Reference backend built on ``scaled_dot_product_attention``.

    Decode gathers every request's keys/values into a padded ``[B, Lmax]`` block
    (one gather per layer for the whole batch); extend runs one SDPA call per
    request, reading its cached prefix through the request table.
    """

    name = "torch"

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        # The request table lives on the CPU; indices and masks go to the pool's device.
        device = self.kv_pool.device
        if batch.mode is ForwardMode.DECODE:
            max_len = max(batch.seq_lens)
            idx = self.req_to_token[batch.req_rows, :max_len]
            lens = torch.tensor(batch.seq_lens, dtype=torch.int64)
            valid = torch.arange(max_len)[None, :] < lens[:, None]
            # Padding points at reserved slot 0 and is masked out.
            batch.attn_metadata["kv_indices"] = idx.masked_fill(~valid, 0).to(device)
            batch.attn_metadata["kv_mask"] = (None if bool(valid.all())
                                              else valid[:, None, None, :].to(device))
        else:
            batch.attn_metadata["prefix_indices"] = [
                self.req_to_token[row, :plen].to(device) if plen else None
                for row, plen in zip(batch.req_rows.tolist(), batch.prefix_lens)
            ]

    def forward(self, q, k, v, layer, batch):
        pool = self.kv_pool
        if batch.mode is ForwardMode.DECODE:
            pool.write(layer, batch.out_cache_loc, k, v)
            return self._decode(q, layer, batch)
        # New keys/values are rounded to the pool's dtype once for the whole batch: the pool
        # stores those values and attention reads them widened back, so a request computes the
        # same whether its prefix came from the cache or was just prefilled.
        k, v = pool.write_rounded(layer, batch.out_cache_loc, k, v, q.dtype)
        return self._extend(q, k, v, layer, batch)

    def _decode(self, q, layer, batch):
        meta = batch.attn_metadata
        idx = meta["kv_indices"]
        # Attention runs in q's dtype whatever the pool stores.
        k_all = self.kv_pool.k_buffers[layer][idx].transpose(1, 2).to(q.dtype)  # [B, kvh, L, d]
        v_all = self.kv_pool.v_buffers[layer][idx].transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), k_all, v_all, attn_mask=meta["kv_mask"],
            scale=self.scaling, enable_gqa=True,
        )
        return out.squeeze(2)

    def _extend(self, q, k, v, layer, batch):
        outs = []
        start = 0
        kb, vb = self.kv_pool.k_buffers[layer], self.kv_pool.v_buffers[layer]
        for n, plen, prefix_idx in zip(batch.extend_lens, batch.prefix_lens,
                                       batch.attn_metadata["prefix_indices"]):
            ki, vi = k[start:start + n], v[start:start + n]  # already through the pool's dtype
            if plen:
                ki = torch.cat((kb[prefix_idx].to(q.dtype), ki))
                vi = torch.cat((vb[prefix_idx].to(q.dtype), vi))
            outs.append(self._attend(q[start:start + n], ki, vi, plen))
            start += n
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _attend(self, q, k, v, plen: int):
        """One request: q [n, h, d] over k/v [plen + n, kvh, d]; token i sees keys 0..plen+i."""
        n = q.shape[0]
        if plen:
            mask = torch.ones(n, plen + n, dtype=torch.bool, device=q.device).tril(diagonal=plen)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                scale=self.scaling, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                scale=self.scaling, enable_gqa=True)
        return out.transpose(0, 1)


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


PAGED_POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e5m2)  # what the C++ decode kernel reads

ATTENTION_BACKENDS: dict[str, Callable[..., AttentionBackend]] = {
    "torch": TorchAttention,
    "cpu_paged": CpuPagedAttention,
}
"""Name -> factory. A GPU backend registers a factory that imports its library lazily."""


def create_attention_backend(name: str, req_to_token: torch.Tensor, kv_pool: KVPool,
                             scaling: float, compute_dtype: torch.dtype = torch.float32) -> AttentionBackend:
    """Build the backend registered under ``name``; ``auto`` picks cpu_paged when its kernels load
    (fp32 queries over a CPU pool of one of ``PAGED_POOL_DTYPES``), else torch."""
    if name == "auto":
        from radixray.kernels.cpu_ops import load_extension
        paged = (kv_pool.device.type == "cpu" and compute_dtype == torch.float32
                 and kv_pool.dtype in PAGED_POOL_DTYPES)
        name = "cpu_paged" if paged and load_extension() else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {sorted(ATTENTION_BACKENDS)}, got {name!r}")
    return ATTENTION_BACKENDS[name](req_to_token, kv_pool, scaling)
