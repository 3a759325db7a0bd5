"""Paged-KV attention backends behind one interface, chosen by name at start-up.

``torch`` is the reference implementation and runs anywhere; ``cpu_paged`` runs the
C++ kernels of :mod:`radixray.kernels`. GPU backends (flashinfer, triton) register
under their own names and import their libraries only when created, so importing
this package never needs a GPU. The kernels they call take tensors only; the
engine's batch and pool types stay here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixray.engine.attention.base import AttentionBackend
from radixray.engine.attention.batch_invariant import BatchInvariantAttention
from radixray.engine.attention.cpu_paged import CpuPagedAttention
from radixray.engine.attention.torch_backend import TorchAttention
from radixray.engine.mem_cache.pool import KVPool

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "BatchInvariantAttention",
           "CpuPagedAttention", "TorchAttention", "create_attention_backend"]

PAGED_POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e5m2)  # what the C++ decode kernel reads

ATTENTION_BACKENDS: dict[str, Callable[..., AttentionBackend]] = {
    "torch": TorchAttention,
    "cpu_paged": CpuPagedAttention,
    "cpu_batch_invariant": BatchInvariantAttention,
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
