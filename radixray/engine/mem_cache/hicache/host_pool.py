"""The host tier's KV store (L2): one row per token slot, all layers' keys and values.

Layout ``[size + 1, num_layers, 2, kv_heads, head_dim]`` (token-major, the "page first"
layout): one token's whole KV is one contiguous row, so a run of slots is one copy to or
from the storage tier, and a device-to-host copy is a gather per layer. Row 0 is never
handed out (slot numbering matches :class:`~radixray.engine.mem_cache.pool.TokenSlotAllocator`).

Two element layouts:

* ``auto``: the KV pool's own dtype. Copies are exact, so a prefix loaded back attends
  to the very values it was computed with (greedy output equals recomputing).
* ``fp8_e4m3``: one byte per element plus a float32 scale per token, layer and K/V
  (amax / 448). Half of bf16, a quarter of fp32; lossy.

The same code runs with the KV pool on a GPU (the store is then in pinned memory) and on
the CPU, where the pool is host memory too and the tier differs only in size and layout.
"""

from __future__ import annotations

import torch

from radixray.engine.mem_cache.pool import KVPool

FP8_E4M3_MAX = 448.0
HOST_DTYPES = ("auto", "fp8_e4m3")


def _select(buf: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``buf[index]`` along dim 0; 1-byte dtypes through a uint8 view (torch's CPU fp8
    lacks index ops)."""
    if buf.element_size() == 1 and buf.dtype != torch.uint8:
        return buf.view(torch.uint8).index_select(0, index).view(buf.dtype)
    return buf.index_select(0, index)


class HostKVPool:
    """``size`` token rows of KV for a device pool of ``num_layers`` x ``kv_heads`` x
    ``head_dim`` in ``pool_dtype``; ``layout`` is one of :data:`HOST_DTYPES`."""

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 pool_dtype: torch.dtype, layout: str = "auto", pin: bool = False):
        if layout not in HOST_DTYPES:
            raise ValueError(f"hicache_host_dtype must be one of {HOST_DTYPES}, got {layout!r}")
        self.size = size
        self.layout = layout
        self.pool_dtype = pool_dtype
        self.fp8 = layout == "fp8_e4m3"
        self.row_shape = (num_layers, 2, num_kv_heads, head_dim)
        self.dtype = torch.float8_e4m3fn if self.fp8 else pool_dtype
        self.data = torch.empty((size + 1, *self.row_shape), dtype=self.dtype, pin_memory=pin)
        self.scales = (torch.empty((size + 1, num_layers, 2), dtype=torch.float32,
                                   pin_memory=pin) if self.fp8 else None)

    @property
    def bytes_per_token(self) -> int:
        n = 1
        for d in self.row_shape:
            n *= d
        scale = 4 * self.row_shape[0] * 2 if self.fp8 else 0
        return n * self.data.element_size() + scale

    # ---------------------------------------------------------------- device copies
    def store(self, pool: KVPool, dev_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copy the KV at device ``dev_slots`` into host rows ``host_slots`` (same length)."""
        ds = dev_slots.to(pool.device)
        k = torch.stack([_select(b, ds) for b in pool.k_buffers], dim=1)  # [n, L, H, D]
        v = torch.stack([_select(b, ds) for b in pool.v_buffers], dim=1)
        self._put(host_slots, torch.stack((k, v), dim=2).to("cpu"))

    def load(self, pool: KVPool, host_slots: torch.Tensor, dev_slots: torch.Tensor) -> None:
        """Copy host rows ``host_slots`` into the device pool at ``dev_slots`` (same length)."""
        rows = self._get(host_slots).to(pool.device)
        ds = dev_slots.to(pool.device)
        for layer in range(self.row_shape[0]):
            pool.write(layer, ds, rows[:, layer, 0].contiguous(), rows[:, layer, 1].contiguous())

    def _put(self, host_slots: torch.Tensor, rows: torch.Tensor) -> None:
        if self.fp8:
            x = rows.float()
            scale = (x.abs().amax(dim=(-2, -1)) / FP8_E4M3_MAX).clamp_min(1e-12)  # [n, L, 2]
            q = (x / scale[..., None, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
            rows = q.to(torch.float8_e4m3fn)
            self.scales.index_copy_(0, host_slots, scale)
        if rows.element_size() == 1:
            self.data.view(torch.uint8).index_copy_(0, host_slots, rows.view(torch.uint8))
        else:
            self.data.index_copy_(0, host_slots, rows.to(self.dtype))

    def _get(self, host_slots: torch.Tensor) -> torch.Tensor:
        """Rows at ``host_slots`` in the pool's dtype (dequantized for fp8)."""
        rows = _select(self.data, host_slots)
        if self.fp8:
            return (rows.float() * _select(self.scales, host_slots)[..., None, None]).to(
                self.pool_dtype if self.pool_dtype.is_floating_point
                and self.pool_dtype.itemsize > 1 else torch.float32)
        return rows

    # ---------------------------------------------------------------- storage blobs
    def export(self, host_slots: torch.Tensor) -> bytes:
        """The rows at ``host_slots`` as bytes (a storage page); :meth:`import_` reads them."""
        parts = [_select(self.data, host_slots).contiguous().view(torch.uint8)]
        if self.fp8:
            parts.append(_select(self.scales, host_slots).contiguous().view(torch.uint8))
        return b"".join(p.numpy().tobytes() for p in parts)

    def import_(self, host_slots: torch.Tensor, blob: bytes, skip: int = 0) -> None:
        """Write rows ``skip:`` of a blob made by :meth:`export` into ``host_slots``."""
        n = len(blob) // self.bytes_per_token
        raw = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        data_bytes = n * (self.bytes_per_token - (8 * self.row_shape[0] if self.fp8 else 0))
        rows = raw[:data_bytes].view(self.dtype).view(n, *self.row_shape)[skip:]
        if rows.element_size() == 1:
            self.data.view(torch.uint8).index_copy_(0, host_slots, rows.view(torch.uint8))
        else:
            self.data.index_copy_(0, host_slots, rows)
        if self.fp8:
            scales = raw[data_bytes:].view(torch.float32).view(n, self.row_shape[0], 2)[skip:]
            self.scales.index_copy_(0, host_slots, scales)
