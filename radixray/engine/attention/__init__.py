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



def _triton(*args) -> AttentionBackend:
    from radixray.engine.attention.triton_backend import TritonAttention
    return TritonAttention(*args)


def _flashinfer(*args) -> AttentionBackend:
    from radixray.engine.attention.flashinfer_backend import FlashInferAttention
    return FlashInferAttention(*args)


ATTENTION_BACKENDS: dict[str, Callable[..., AttentionBackend]] = {
    "torch": TorchAttention,
    "cpu_paged": CpuPagedAttention,
    "cpu_batch_invariant": BatchInvariantAttention,
    "triton": _triton,
    "flashinfer": _flashinfer,
}
"""Name -> factory. A GPU backend's factory imports its module (and library) when called."""


def create_attention_backend(name: str, req_to_token: torch.Tensor, kv_pool: KVPool,
                             scaling: float, compute_dtype: torch.dtype = torch.float32) -> AttentionBackend:
    """Build the backend registered under ``name``. ``auto``: on CUDA, triton when it is
    installed (else torch); on the CPU, cpu_paged when its kernels load (fp32 queries over a
    pool of one of ``PAGED_POOL_DTYPES``), else torch."""
    if name == "auto":
        name = _auto(kv_pool, compute_dtype)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {sorted(ATTENTION_BACKENDS)}, got {name!r}")
    return ATTENTION_BACKENDS[name](req_to_token, kv_pool, scaling)


def _auto(kv_pool: KVPool, compute_dtype: torch.dtype) -> str:
    if kv_pool.device.type == "cuda":
        from radixray.engine.attention.triton_backend import triton_usable
        return "triton" if triton_usable(kv_pool.device) is None else "torch"
    from radixray.kernels.cpu_ops import load_extension
    paged = (kv_pool.device.type == "cpu" and compute_dtype == torch.float32
             and kv_pool.dtype in PAGED_POOL_DTYPES)
    return "cpu_paged" if paged and load_extension() else "torch"
