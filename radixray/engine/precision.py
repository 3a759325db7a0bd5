"""The default precision: what ``quantization="auto"`` becomes at start-up, and why.

On a CPU a decode step is bound by the bytes it reads (weights, then the KV cache), so
the default on CPUs with the C++ int8 kernels for every row count (AVX-512 VNNI, AMX) is
the measured fast configuration:

- ``w8a8_int8`` for every linear layer and the lm_head (int8 weights per channel, int8
  activations per token; kernels/int8_linear.py), activations in fp32;
- an ``fp8_e5m2`` KV pool (a quarter of fp32's bytes), unless ``kv_cache_dtype`` is set;
- decode steps through torch.compile (``enable_torch_compile``, unless set): on a 2-vCPU
  AVX-512 VNNI EPYC it cut the batch-1 step from 23.1 to 18.8 ms and the served c=1 TPOT
  from 29.3 to 21.1 ms (docs/benchmarks.md), for ~35 s of compiling at the first start.

What it costs in quality is measured (``radixray bench quant-quality``; docs/quantization.md
has the figures per model) and checked against a stated bound by
tests/cpu/test_default_precision.py. ``exact=true`` (``--exact``) keeps the unquantized
path, whose greedy output equals Hugging Face's; so does any case the bundle was not
measured for: a GPU, deterministic mode, a mixture-of-experts model, tensor parallelism,
a non-fp32 dtype, or a CPU without those kernels (AVX2 alone). ``RADIXRAY_EXACT=1`` in the environment
makes ``exact`` the process's default (the test suite sets it: most tests compare with
Hugging Face's fp32 outputs).

An explicit ``quantization`` (``w8a8_int8``, or None for none) is used as given, with
``kv_cache_dtype`` and ``quantize_lm_head`` as given.
"""

from __future__ import annotations

import dataclasses
import os

from radixray.kernels.int8_linear import SMALL_M_MAX

EXACT_ENV = "RADIXRAY_EXACT"

# The int8 GEMMs (int8_linear.int8_kernel_kind) the bundle is the default on. On AVX2
# without VNNI only batches of up to SMALL_M_MAX rows have a C++ kernel; more rows (every
# prefill, larger decode batches) go to torch._int_mm, which ran a 1,024-token prefill of
# the default model at 5 tokens/s on an AVX2 EPYC (docs/quantization.md).
FAST_ON = ("amx", "avx512_vnni")

# The bundle quantization="auto" turns into where it applies.
# (dtype "auto" is fp32 on CPUs: the bundle's activations.)
FAST_DEFAULT = {"quantization": "w8a8_int8", "quantize_lm_head": True,
                "kv_cache_dtype": "fp8_e5m2"}


def exact_requested(config) -> bool:
    return bool(config.exact) or os.environ.get(EXACT_ENV) == "1"


def why_exact(config, hf_config, int8_kernel: str | None) -> str | None:
    """Why ``quantization="auto"`` stays unquantized for ``config`` (None: the fast default
    applies). ``int8_kernel``: the int8 GEMM this CPU runs (:func:`int8_kernel_kind`)."""
    if config.exact:
        return "exact=true"
    if os.environ.get(EXACT_ENV) == "1":
        return f"{EXACT_ENV}=1"
    if config.device != "cpu":
        return f"device {config.device} (the int8 bundle is a CPU configuration)"
    if config.deterministic:
        return "deterministic mode computes in fp32"
    if config.dtype not in ("auto", "float32"):
        return f"dtype={config.dtype} asked"
    if config.tp_size > 1:
        return "tensor parallelism (the bundle is measured on single-rank workers)"
    if _is_moe(hf_config):
        return "a mixture-of-experts model (its experts have no int8 path)"
    if int8_kernel is None:
        return "the C++ int8 kernels did not load on this machine"
    if int8_kernel not in FAST_ON:
        return (f"this CPU's int8 GEMM ({int8_kernel}) has no fast kernel above "
                f"{SMALL_M_MAX} rows: prefills and batched decodes would run slower than fp32")
    return None


def _is_moe(hf_config) -> bool:
    from radixray.engine.models.moe import MOE_MODEL_TYPES
    return getattr(hf_config, "model_type", None) in MOE_MODEL_TYPES


def int8_kernel_kind() -> str | None:
    """The int8 GEMM decode runs here: ``amx``, ``avx512_vnni``, ``avx2``, or None (no C++
    kernels: the bundle would fall back to slow torch ops)."""
    from radixray.kernels.cpu_ops import load_extension
    from radixray.kernels.int8_linear import amx_available, vnni_available
    ext = load_extension()
    if ext is None:
        return None
    if amx_available(ext):
        return "amx"
    return "avx512_vnni" if vnni_available(ext) else "avx2"


def resolve_precision(config, hf_config) -> tuple[object, str]:
    """``config`` with ``quantization="auto"`` replaced by what runs, and the reason (for the
    start-up log). Other configs come back unchanged."""
    if config.quantization != "auto":
        return config, "as configured"
    kernel = None if exact_requested(config) or config.device != "cpu" else int8_kernel_kind()
    reason = why_exact(config, hf_config, kernel)
    if reason is not None:
        return dataclasses.replace(config, quantization=None, quantize_lm_head=False), \
            f"exact: {reason}"
    fast = dict(FAST_DEFAULT)
    if config.kv_cache_dtype != "auto":
        fast["kv_cache_dtype"] = config.kv_cache_dtype
    if config.enable_torch_compile is None:
        fast["enable_torch_compile"] = True
    compiled = ", compiled decode" if fast.get("enable_torch_compile", config.enable_torch_compile) else ""
    return dataclasses.replace(config, **fast), (
        f"fast CPU default on {kernel}: int8 weights and activations (lm_head included), "
        f"{fast['kv_cache_dtype']} KV cache{compiled}; quality cost measured in "
        "docs/quantization.md; --exact for the fp32 path (greedy output equal to Hugging Face's)")
