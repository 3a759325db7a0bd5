"""EngineConfig: every start-up option of one worker's engine, validated on construction.

This is the one declaration of the engine's options: the serve YAML schema's ``engine:``
section (``cluster/config.py``) and the ``radixray serve`` / ``generate`` / ``bench
offline`` flags are derived from it (:mod:`radixray.engine.options`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from radixray.engine import options
from radixray.engine.options import option
from radixray.engine.sched.policy import SCHEDULE_POLICIES
from radixray.engine.speculative.options import SPECULATIVE_ALGORITHMS, check_speculative
from radixray.engine.weights.lora_options import check_lora
from radixray.kernels import QUANTIZATIONS

DTYPES = ("auto", "float32", "bfloat16")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e5m2")  # auto: the model's dtype
DEVICE_PATTERN = r"^(cpu|cuda(:\d+)?)$"


@dataclass(frozen=True)
class EngineConfig:
    """Start-up options. ``None`` means: compute it at start-up and log the result."""

    model: str = option("default", "'default' (SmolLM2-135M GGUF), a Hugging Face folder or "
                        "a .gguf file")
    dtype: str = option("auto", "weights and activations; auto picks the faster of fp32 and "
                        "bf16 measured on this machine", choices=DTYPES)
    device: str = option("cpu", "cpu, cuda or cuda:N (serving on cuda needs "
                         "server.worker_num_gpus)", pattern=DEVICE_PATTERN,
                         shape="'cpu', 'cuda' or 'cuda:N'")
    kv_cache_dtype: str = option("auto", "KV pool element type (auto: the model's; bfloat16 "
                                 "halves its bytes, fp8_e5m2 quarters them against fp32, at "
                                 "some quality cost)", choices=KV_CACHE_DTYPES)
    quantization: str | None = option(
        "auto", "auto: on CPUs with the C++ int8 kernels, int8 weights and activations (lm_head "
        "included) and an fp8_e5m2 KV cache, the measured fast default (its quality cost: "
        "docs/quantization.md), elsewhere none; w8a8_int8: int8 linear layers; None: none",
        choices=("auto",) + QUANTIZATIONS)
    quantize_lm_head: bool = option(False, "with w8a8_int8: the lm_head too (faster decode at "
                                    "batch, some quality cost: see bench quant-quality)")
    exact: bool = option(False, "the unquantized path (quantization auto becomes none; fp32 "
                         "on CPUs): greedy output equal to Hugging Face's, slower on CPUs "
                         "(engine/precision.py)")
    mem_fraction_static: float = option(0.3, "share of available memory for weights + KV pool",
                                        gt=0.0, lt=1.0)
    max_total_tokens: int | None = option(None, "KV pool size in tokens (overrides "
                                          "mem_fraction_static)", ge=2)
    chunked_prefill_size: int | None = option(2048, "most prompt tokens one prefill chunk takes; "
                                              "None or <= 0 disables chunking")
    max_prefill_tokens: int = option(16384, "most new tokens one prefill batch takes", ge=1)
    max_running_requests: int | None = option(None, "most requests decoding together "
                                              "(default: computed from the pool)", ge=1)
    context_length: int | None = option(None, "longest sequence (default: the model's)", ge=2)
    schedule_policy: str = option("fcfs", "waiting-queue order: fcfs, or lpm (longest cached "
                                  "prefix first)", choices=SCHEDULE_POLICIES)
    schedule_conservativeness: float = option(1.0, "scales the new-token-ratio forecast that "
                                              "admission reserves for running requests", gt=0.0)
    enable_priority_scheduling: bool = option(False, "order by request priority and preempt "
                                              "lower-priority running requests")
    priority_preemption_threshold: int = option(10, "priority gap a waiting request needs to "
                                                "preempt a running one")
    enable_mixed_chunk: bool = option(True, "running decode requests ride along in each "
                                      "prefill forward (one token each) instead of waiting "
                                      "for the prefill wave to end (docs/mixed_chunk.md)")
    max_itl_ms: float | None = option(
        500.0, "with enable_mixed_chunk: the inter-token-latency target a prefill step with "
        "riders is sized by (its prompt tokens: as many as a cost model measured online "
        "predicts fit, 32 to chunked_prefill_size); 0 or None: fixed chunks of "
        "chunked_prefill_size, the riders taking up to half", ge=0)
    disable_radix_cache: bool = option(False, "no prefix sharing between requests")
    radix_eviction_policy: str = option("lru", "which cached prefixes go first when the pool "
                                        "is full", choices=("lru", "lfu"))
    enable_hierarchical_cache: bool = option(
        False, "HiCache: keep cached prefixes evicted from the KV pool in a larger host tier "
        "(and optionally a storage tier) and load them back on a hit instead of recomputing")
    hicache_ratio: float = option(2.0, "with enable_hierarchical_cache: host tier size as a "
                                  "multiple of the KV pool's tokens", gt=0.0)
    hicache_size: float | None = option(None, "with enable_hierarchical_cache: host tier size "
                                        "in GiB (overrides hicache_ratio)", gt=0.0)
    hicache_write_policy: str = option(
        "write_through", "when a cached prefix gets its host copy: write_through (when "
        "cached), write_through_selective (once a second request uses it), write_back (when "
        "the KV pool evicts it)",
        choices=("write_through", "write_through_selective", "write_back"))
    hicache_host_dtype: str = option(
        "auto", "host tier layout: auto (the KV pool's dtype, lossless) or fp8_e4m3 (one byte "
        "per element plus a scale per token, layer and K/V; lossy)", choices=("auto", "fp8_e4m3"))
    hicache_storage_backend: str | None = option(
        None, "with enable_hierarchical_cache: a third tier under the host tier, keyed by a "
        "content hash of the prefix's token pages (file: hicache_storage_dir)",
        choices=(None, "file", "mooncake"))
    hicache_storage_dir: str | None = option(None, "the file storage backend's folder")
    attention_backend: str = option("auto", "auto, torch, cpu_paged, triton (CUDA; the CPU "
                                    "only under TRITON_INTERPRET=1) or flashinfer (CUDA); auto: "
                                    "triton on CUDA, cpu_paged on the CPU")
    disable_cuda_graph: bool = option(False, "run every decode step eagerly on CUDA (no "
                                      "captured graphs)")
    cuda_graph_max_bs: int | None = option(None, "the largest decode batch run through a CUDA "
                                           "graph (default: sized from the device's memory)",
                                           ge=1)
    enable_torch_compile: bool | None = option(
        None, "CPU: run decode steps through torch.compile (inductor; the C++ kernels kept "
        "as its ops): the same logits, less Python per step; compiled at start-up, cached "
        "across restarts (engine/executor/compiled_decode.py); default: on with the fast "
        "CPU precision (engine/precision.py), off otherwise")
    torch_compile_max_bs: int = option(32, "with enable_torch_compile: the largest decode "
                                       "batch run compiled (larger ones run eagerly)", ge=1)
    cpu_kernels: bool = option(True, "fused C++ kernels for fp32 on CPU (torch ops otherwise)")
    decode_log_interval: int = option(40, "decode steps between two decode log lines", ge=1)
    stream_interval: int = option(1, "decode steps between a request's streamed updates "
                                  "(the first token and the finish always go at once)", ge=1)
    num_threads: int | None = option(None, "torch intra-op threads on CPU (default: torch's, "
                                     "or the worker's or TP rank's share of the cores)", ge=1)
    random_seed: int = option(0, "seed of the engine's generators")
    deterministic: bool = option(False, "batch-invariant forward and sampling: a request gets "
                                 "the same tokens and logprobs whatever batch and prefill "
                                 "chunks it runs in (CPU, float32; slower prefill; a sampled "
                                 "request without a seed gets seed 42)")
    disaggregation_mode: str | None = option(
        None, "prefill or decode: this engine is one half of a prefill-decode pair (its "
        "requests carry a bootstrap room and arrive through the router); None: it does both",
        choices=(None, "prefill", "decode"))
    disaggregation_bootstrap_timeout_s: float = option(
        300.0, "prefill side: how long a request waits for its decode worker's KV "
        "destination (the decode side may be waiting for free KV slots meanwhile)", gt=0.0)
    disaggregation_waiting_timeout_s: float = option(
        300.0, "decode side: how long a request with reserved KV slots waits for the prefill "
        "worker's transfer (covers the prefill queue and the prefill itself)", gt=0.0)
    disaggregation_transfer_protocol: str = option(
        "tcp", "Mooncake transport between prefill and decode workers (rdma on clusters "
        "with RDMA NICs)", choices=("tcp", "rdma"))
    disaggregation_transfer_host: str | None = option(
        None, "address this engine's transfer engine listens on (None: the address of the "
        "Ray node a serving worker runs on, 127.0.0.1 in-process)")
    check_kv_conservation: bool = option(False, "assert the KV slot invariant after every "
                                         "step (tests)")
    kv_audit_interval_steps: int = option(
        256, "check the KV slot accounting every this many scheduler steps, in production "
        "(counters only; radixray:kv_slot_leak; 0 turns it off)", ge=0)
    max_consecutive_failed_steps: int = option(3, "a fault in this many scheduler steps in a "
                                               "row fails the engine (requests then get 503 "
                                               "and a serving worker is restarted)", ge=1)
    ep_num_redundant_experts: int = option(
        0, "MoE models: spare physical expert slots per MoE layer, holding copies of the "
        "busiest experts (weight loading and updates write every copy)", ge=0)
    enable_eplb: bool = option(False, "MoE models: count the tokens routed to each expert "
                               "and move the redundant copies to even out the load (EPLB)")
    eplb_rebalance_num_iterations: int = option(
        1000, "with enable_eplb: forward passes between two automatic rebalances (0: only "
        "when asked, Engine.rebalance_experts)", ge=0)
    eplb_window_size: int = option(1000, "with enable_eplb: the forward passes whose expert "
                                   "load a rebalance plans for (a sliding window)", ge=1)
    enable_overlap_schedule: bool = option(
        False, "run each decode step's forward pass in a forward thread while the scheduler "
        "takes in the step before (engine/sched/overlap.py); identical tokens")
    enable_return_routed_experts: bool = option(
        False, "MoE models: keep the routers' choices of every token in the KV pool, so "
        "return_routed_experts covers a request's whole sequence, cached prefix included")
    ep_size: int = option(1, "MoE models: expert parallelism over this many ranks (one "
                          "process each; a serving worker becomes a group of rank actors), "
                          "each holding 1/ep_size of the expert slots and its own requests",
                          ge=1)
    ep_dispatch_backend: str = option(
        "collectives", "with ep_size > 1: how tokens reach the ranks of their experts "
        "(collectives: torch.distributed all_to_all, CPU and GPU; deepep: DeepEP kernels, GPU)",
        choices=("collectives", "deepep"))
    ep_timeout_s: float = option(300.0, "with ep_size > 1: a collective waiting this long "
                                 "for a rank fails the group (which is restarted whole)", gt=0)
    tp_size: int = option(1, "tensor parallelism over this many ranks (one process each: "
                          "rank 0 schedules, the others follow its forward passes; "
                          "docs/tensor_parallelism.md); it must divide the query heads, and "
                          "the KV heads or be a multiple of them", ge=1)
    tp_timeout_s: float = option(300.0, "with tp_size > 1: a collective waiting this long "
                                 "for a rank fails the group", gt=0)
    grammar_backend: str = option("xgrammar", "structured output (json_schema, regex, ebnf, "
                                  "structural_tag, response_format): xgrammar, or none to "
                                  "refuse such requests", choices=("xgrammar", "none"))
    grammar_compile_threads: int = option(2, "threads compiling grammars off the scheduler "
                                          "thread", ge=1)
    grammar_cache_size: int = option(512, "compiled grammars kept (most recently used), "
                                     "failed ones included", ge=1)
    grammar_json_max_whitespace: int | None = option(
        16, "most whitespace characters in a row a JSON schema (also one inside a structural "
        "tag) lets the model write (bounds a model stuck on whitespace; None: unbounded)",
        ge=0)
    speculative_algorithm: str | None = option(
        None, "NGRAM: draft tokens from n-grams of each request's own prompt and output, "
        "verified in one forward (greedy output unchanged, sampled output distributed the "
        "same); caps max_running_requests at 48 unless set", choices=SPECULATIVE_ALGORITHMS)
    speculative_num_draft_tokens: int = option(
        8, "with speculation: tokens per request in one verify forward (its last token plus "
        "up to this many minus one draft tokens)", ge=2)
    speculative_ngram_min_match_window_size: int = option(
        1, "NGRAM: fewest trailing tokens that must match an earlier n-gram to draft", ge=1)
    speculative_ngram_max_match_window_size: int = option(
        12, "NGRAM: longest match considered when choosing among earlier occurrences", ge=1)
    enable_lora: bool = option(
        False, "serve LoRA adapters (PEFT format) on the attention and MLP projections, "
        "chosen per request (lora_path); implied by lora_paths")
    lora_paths: tuple[str, ...] | None = option(
        None, "adapters loaded at start-up, each 'name=path' (a PEFT folder: "
        "adapter_config.json + adapter_model.safetensors) or a bare path (its own name)")
    max_loras_per_batch: int = option(
        8, "with LoRA: adapter slots, the most distinct adapters one batch (and the running "
        "requests together) use; others wait", ge=1)
    max_lora_rank: int | None = option(
        None, "with LoRA: the largest adapter rank the slots hold (default: the largest of "
        "lora_paths' adapters, 16 without any); a larger adapter is refused", ge=1)

    def __post_init__(self):
        if isinstance(self.lora_paths, list):  # a Python caller's list: the frozen form is a tuple
            object.__setattr__(self, "lora_paths", tuple(self.lora_paths))
        options.validate(self)
        if self.quantization == "w8a8_int8" and self.device != "cpu":
            raise ValueError("quantization='w8a8_int8' runs on the CPU only (device='cpu')")
        if self.deterministic:
            self._check_deterministic()
        if self.enable_return_routed_experts and self.disaggregation_mode is not None:
            raise ValueError("enable_return_routed_experts with disaggregation_mode: the "
                             "prompt's routes stay on the prefill worker; turn one of them off")
        if (self.hicache_storage_backend or self.hicache_size) and not self.enable_hierarchical_cache:
            raise ValueError("hicache_storage_backend and hicache_size need "
                             "enable_hierarchical_cache=true")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError("enable_hierarchical_cache needs the radix cache "
                             "(disable_radix_cache=false)")
        if self.hicache_storage_backend == "file" and not self.hicache_storage_dir:
            raise ValueError("hicache_storage_backend='file' needs hicache_storage_dir")
        if self.quantize_lm_head and self.quantization != "w8a8_int8":
            raise ValueError("quantize_lm_head needs quantization='w8a8_int8', got "
                             f"quantization={self.quantization!r}")
        if self.exact and self.quantization not in (None, "auto"):
            raise ValueError(f"exact=true runs unquantized, got quantization="
                             f"{self.quantization!r}: drop one of them")
        check_speculative(self)
        check_lora(self)

    def _check_deterministic(self) -> None:
        """Deterministic mode runs the batch-invariant CPU kernels: fp32 weights and KV pool,
        no int8; ValueError naming the first option that conflicts."""
        wanted = {"device": ("cpu",), "dtype": ("auto", "float32"), "kv_cache_dtype": ("auto",),
                  "quantization": (None, "auto"), "cpu_kernels": (True,),
                  "attention_backend": ("auto", "cpu_batch_invariant")}
        for name, allowed in wanted.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"deterministic=true needs {name} in {list(allowed)}, got "
                                 f"{value!r}: batch-invariant kernels exist for float32 on the "
                                 f"CPU only")

    @property
    def itl_budget_off_reason(self) -> str | None:
        """Why prefill steps take fixed chunks instead of ``max_itl_ms``'s budget, or None
        when the budget sizes them (engine/sched/chunk_budget.py)."""
        if not self.max_itl_ms:
            return "max_itl_ms is 0"
        if not self.enable_mixed_chunk:
            return "enable_mixed_chunk is off (no streams ride a prefill step)"
        if self.chunk_size is None:
            return "chunked prefill is off"
        if self.deterministic:
            return "deterministic mode: a step's size must not depend on timing"
        if self.ep_size > 1:
            return ("expert parallelism: a rank's forward time includes waiting for its "
                    "peers' exchanges, not only its own batch")
        if self.disaggregation_mode == "prefill":
            return "a prefill worker has no decode streams to pace"
        return None

    @property
    def itl_budget_ms(self) -> float | None:
        """The inter-token-latency target mixed prefill steps are sized by, or None (fixed
        chunks; :attr:`itl_budget_off_reason` says why)."""
        return None if self.itl_budget_off_reason else self.max_itl_ms

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_paths)

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
