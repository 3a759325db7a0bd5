"""KV memory: per-layer key/value pool tensors, the request-to-token table and the slot allocator.

Capacity is counted in token slots. Slot 0 of the KV pool and row 0 of the
request table are reserved as padding targets, so padded batch entries read and
write somewhere harmless; a pool of ``size`` usable tokens therefore holds
``size + 1`` slots.
"""

from __future__ import annotations

import torch

from radixray.engine.mem_cache.hugepages import empty_huge


class TokenSlotAllocator:
    """Free list of KV slot indices ``1..size``.

    ``alloc(n)`` hands out ``n`` distinct free slots or returns ``None`` without
    changing anything when fewer than ``n`` are free. ``free(slots)`` takes slots
    back; freeing a slot twice is a caller bug (checked by ``debug_check``).
    """

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"KV pool size must be >= 1 token, got {size}")
        self.size = size
        self._free = torch.arange(1, size + 1, dtype=torch.int64)

    def available_size(self) -> int:
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self._free.numel():
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free = torch.cat((self._free, slots.to(torch.int64)))

    def reset(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64)

    def debug_check(self) -> None:
        """Raise if a slot is free twice or slot 0 leaked into the free list."""
        uniq = torch.unique(self._free)
        if uniq.numel() != self._free.numel():
            raise AssertionError("a KV slot is on the free list twice")
        if self._free.numel() and int(self._free.min()) < 1:
            raise AssertionError("reserved slot 0 is on the free list")


class ReqToTokenPool:
    """Table with one row per running request; cell ``[row, pos]`` is the KV slot of token ``pos``.

    Row 0 is padding and never handed out.
    """

    def __init__(self, max_requests: int, context_len: int):
        self.max_requests = max_requests
        self.context_len = context_len
        # Unwritten cells are never read unmasked, so only padding row 0 needs zeros;
        # torch.empty leaves the rest of the pages untouched until a request uses them.
        self.table = torch.empty((max_requests + 1, context_len), dtype=torch.int64)
        self.table[0].zero_()
        self._free_rows = list(range(max_requests, 0, -1))
        # how many times each row was handed out: a row's cells belong to one request per
        # lease (a tensor-parallel driver resends a row's prefix on a new lease)
        self.leases = [0] * (max_requests + 1)

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self.leases[row] += 1
        return row

    def free(self, row: int) -> None:
        self._free_rows.append(row)


FP8_E5M2_MAX = 57344.0  # the largest finite float8_e5m2


def to_pool_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the pool stores it: fp8 saturates at its largest finite value instead of
    overflowing to inf (torch's cast does the latter). ``x`` itself when already ``dtype``."""
    if x.dtype == dtype:
        return x
    if dtype == torch.float8_e5m2:
        x = x.clamp(-FP8_E5M2_MAX, FP8_E5M2_MAX)
    return x.to(dtype)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """2 (key and value) x layers x kv heads x head dim x bytes per element."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class KVPool:
    """Per-layer key and value tensors of shape ``[size + 1, num_kv_heads, head_dim]``."""

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu", ext=None):
        self.size = size
        self.ext = ext  # the CPU kernels (kv_store), or None for torch ops
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (size + 1, num_kv_heads, head_dim)
        # Slots are written before they are read; padding slot 0 must hold finite values
        # because masked attention still multiplies it by a zero weight.
        alloc = (lambda: empty_huge(shape, dtype)) if str(device) == "cpu" else \
            (lambda: torch.empty(shape, dtype=dtype, device=device))
        self.k_buffers = [alloc() for _ in range(num_layers)]
        self.v_buffers = [alloc() for _ in range(num_layers)]
        for buf in self.k_buffers + self.v_buffers:
            buf[0].zero_()

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values ``[n, kv_heads, head_dim]`` of ``n`` tokens at ``slots``.

        fp32 rows take one C++ call that casts and scatters K and V (vectorized, c10's
        rounding); without the kernels, torch's cast and ``index_copy_``. Same values either way."""
        if self._fused(k):
            self.ext.kv_store(self.k_buffers[layer], self.v_buffers[layer], slots, k, v)
            return
        for buf, x in ((self.k_buffers[layer], k), (self.v_buffers[layer], v)):
            x = to_pool_dtype(x, self.dtype)
            if x.element_size() == 1:  # torch has no index_copy_ for fp8 on the CPU: copy the bytes
                buf, x = buf.view(torch.uint8), x.view(torch.uint8)
            buf.index_copy_(0, slots, x)

    def write_rounded(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`write`, returning the keys/values as stored, widened to ``out_dtype``: what
        attention over the pool reads for these tokens (one C++ pass for fp32 in and out)."""
        if self._fused(k) and out_dtype == torch.float32:
            k_r, v_r = self.ext.kv_store_rounded(self.k_buffers[layer], self.v_buffers[layer], slots, k, v)
            return k_r, v_r
        k, v = to_pool_dtype(k, self.dtype), to_pool_dtype(v, self.dtype)
        self.write(layer, slots, k, v)
        return k.to(out_dtype), v.to(out_dtype)

    def _fused(self, k: torch.Tensor) -> bool:
        return self.ext is not None and k.dtype == torch.float32 and k.device.type == "cpu"
