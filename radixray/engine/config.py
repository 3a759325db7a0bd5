"""EngineConfig: every start-up option of one worker's engine, validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from radixray.engine.policy import SCHEDULE_POLICIES
from radixray.kernels.int8_linear import QUANTIZATIONS

DTYPES = ("auto", "float32", "bfloat16")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e5m2")  # auto: the model's dtype
DEVICE_PATTERN = r"^(cpu|cuda(:\d+)?)$"


@dataclass(frozen=True)
class EngineConfig:
    """Start-up options. ``None`` means: compute it at start-up and log the result."""

    model: str = "default"  # "default" (SmolLM2-135M GGUF), a Hugging Face folder, or a .gguf file
    dtype: str = "auto"  # auto picks the faster of fp32 / bf16 measured on this machine
    device: str = "cpu"
    kv_cache_dtype: str = "auto"  # "bfloat16" halves the KV pool's bytes, "fp8_e5m2" quarters them (vs fp32)
    quantization: str | None = None  # None (weights as loaded) or "w8a8_int8" (int8 GEMMs, CPU)
    quantize_lm_head: bool = False  # w8a8_int8 only: the lm_head too (faster decode, some quality cost)
    mem_fraction_static: float = 0.3  # share of available memory for weights + KV pool
    max_total_tokens: int | None = None  # explicit KV pool size in tokens (overrides the fraction)
    chunked_prefill_size: int | None = 2048  # None or <= 0 disables chunking
    max_prefill_tokens: int = 16384
    max_running_requests: int | None = None
    context_length: int | None = None
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    enable_priority_scheduling: bool = False
    priority_preemption_threshold: int = 10
    disable_radix_cache: bool = False
    radix_eviction_policy: str = "lru"
    attention_backend: str = "auto"  # auto | torch | cpu_paged
    cpu_kernels: bool = True  # fused C++ kernels for fp32 on CPU (torch ops otherwise)
    decode_log_interval: int = 40
    stream_interval: int = 1  # decode steps between a request's streamed updates (first and last always go)
    num_threads: int | None = None  # torch intra-op threads (CPU); None keeps torch's default
    random_seed: int = 0
    check_kv_conservation: bool = False  # assert the slot invariant after every step (tests)
    # a fault in this many scheduler steps in a row marks the engine failed (requests get 503)
    max_consecutive_failed_steps: int = 3

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if not re.fullmatch(DEVICE_PATTERN, self.device):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.quantization == "w8a8_int8" and self.device != "cpu":
            raise ValueError("quantization='w8a8_int8' runs on the CPU only (device='cpu')")
        if self.quantize_lm_head and self.quantization != "w8a8_int8":
            raise ValueError("quantize_lm_head needs quantization='w8a8_int8', got "
                             f"quantization={self.quantization!r}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ValueError(f"max_total_tokens must be >= 2, got {self.max_total_tokens}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.radix_eviction_policy not in ("lru", "lfu"):
            raise ValueError(f"radix_eviction_policy must be 'lru' or 'lfu', got {self.radix_eviction_policy!r}")
        if self.schedule_conservativeness <= 0:
            raise ValueError("schedule_conservativeness must be > 0")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.max_consecutive_failed_steps < 1:
            raise ValueError("max_consecutive_failed_steps must be >= 1, got "
                             f"{self.max_consecutive_failed_steps}")
        if self.decode_log_interval < 1:
            raise ValueError("decode_log_interval must be >= 1")

    @property
    def chunk_size(self) -> int | None:
        c = self.chunked_prefill_size
        return c if c is not None and c > 0 else None

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known options: {sorted(known)}")
        return cls(**kwargs)
