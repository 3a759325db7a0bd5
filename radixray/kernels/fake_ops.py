"""Shape-and-dtype ("fake") implementations of the C++ ops, for torch.compile.

torch.compile traces a function with fake tensors (no data): every custom op it meets
needs a function that returns empty outputs of the right shape, dtype and device, or the
trace fails. With these registered, a compiled graph keeps each ``radixray::`` op as one
opaque call (inductor fuses the torch ops around them, not the kernels themselves), so a
compiled step computes exactly what the eager step computes.

``register_fake_ops`` runs once, after the extension's library is loaded (the ops must
exist before a fake can be attached to them).
"""

from __future__ import annotations

import torch

_registered = False


def register_fake_ops() -> None:
    """Attach a fake implementation to every tensor-valued ``radixray::`` op (idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True
    for name, fake in _FAKES.items():
        torch.library.register_fake(f"radixray::{name}", fake)


def _rows(x: torch.Tensor, cols: int, dtype: torch.dtype) -> torch.Tensor:
    return x.new_empty((x.shape[0], cols), dtype=dtype)


def _codes(x: torch.Tensor, cols: int) -> list[torch.Tensor]:
    """int8 codes [M, cols] and their fp32 per-row scales [M]."""
    return [_rows(x, cols, torch.int8), x.new_empty((x.shape[0],), dtype=torch.float32)]


_FAKES = {
    # fp32 kernels (csrc/cpu_ops.cpp)
    "linear_small_m": lambda x, w: _rows(x, w.shape[0], x.dtype),
    "rms_norm": lambda x, w, eps: torch.empty_like(x),
    "add_rms_norm": lambda x, residual, w, eps: [torch.empty_like(x), torch.empty_like(x)],
    "silu_mul": lambda gate_up: gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2)),
    "rotary": lambda x, positions, cos, sin: torch.empty_like(x),
    # int8 halves and GEMMs (csrc/int8_ops.cpp, csrc/int8_vnni.cpp)
    "quantize_rows_int8": lambda x: _codes(x, x.shape[1]),
    "rescale_int8_acc": lambda acc, x_scale, w_scale, bias: _rows(acc, acc.shape[1], torch.float32),
    "rescale_silu_mul_quantize": lambda acc, x_scale, w_scale, bias: _codes(acc, acc.shape[1] // 2),
    "int8_gemm_small_m": lambda x, w: _rows(x, w.shape[0], torch.int32),
    "int8_vnni_gemm": lambda x, packed, comp, n: _rows(x, n, torch.int32),
    "int8_vnni_linear": lambda x, x_scale, packed, comp, w_scale, bias, n:
        _rows(x, n, torch.float32),
    "int8_vnni_gated_codes": lambda x, packed, comp, w_scale, bias, n: _codes(x, n // 2),
    # attention and the KV pool (csrc/attention*.cpp, csrc/kv_store.cpp)
    "paged_decode_attention": lambda q, k_pool, v_pool, kv_indices, seq_lens, scale:
        torch.empty_like(q),
    "extend_attention": lambda q, k, v, prefix_len, scale: torch.empty_like(q),
    "extend_attention_bf16": lambda q, k, v, prefix_len, scale:
        torch.empty_like(q, dtype=torch.float32),
    "kv_store": lambda k_buf, v_buf, slots, k, v: None,
    "kv_store_rounded": lambda k_buf, v_buf, slots, k, v: [torch.empty_like(k),
                                                           torch.empty_like(v)],
}
