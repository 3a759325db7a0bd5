"""ModelRunner: loads the model, sizes and owns the KV memory, turns scheduled requests into logits."""

from __future__ import annotations

import logging
import time

import torch

from radixray.engine.attention import create_attention_backend
from radixray.engine.config import EngineConfig
from radixray.engine.control import ModelFacts
from radixray.engine.ep.eplb import model_expert_options
from radixray.engine.ep.group import join_ep_group
from radixray.engine.executor.compiled_decode import build_compiled_decode
from radixray.engine.executor.cuda_graph import build_decode_graphs
from radixray.engine.executor.forward_batch import ForwardBatch, ForwardMode
from radixray.engine.executor.prompt_logprobs import compute_prompt_logprobs, plan_prompt_rows
from radixray.engine.mem_cache.hugepages import pack_parameters_into_huge_pages
from radixray.engine.mem_cache.pool import (
    KVPool,
    ReqToTokenPool,
    TokenSlotAllocator,
    kv_bytes_per_token,
)
from radixray.engine.models import model_class_for
from radixray.engine.models.routed_experts import SlotRoutes, record_routes
from radixray.engine.precision import resolve_precision
from radixray.engine.request import Req
from radixray.engine.speculative.options import speculative_running_rows
from radixray.engine.tp.launch import join_tp_group
from radixray.engine.tp.options import check_tp_options, tp_summary
from radixray.engine.tp.runtime import DriverMirror, Stop
from radixray.engine.weights.loader import ModelSource
from radixray.engine.weights.lora_slots import make_lora_slots
from radixray.kernels.cpu_ops import BatchInvariantKernels, CpuKernels
from radixray.kernels.int8_linear import quantize_linears

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_KV_DTYPES = {"bfloat16": torch.bfloat16, "fp8_e5m2": torch.float8_e5m2}


def available_memory_bytes(device: str) -> int:
    """Memory a new allocation can use now: MemAvailable on CPU, free device memory on CUDA."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def head_dim_of(hf) -> int:
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def attention_scaling(hf) -> float:
    """The softmax scale of the model's attention: 1/sqrt(query_pre_attn_scalar or head_dim)."""
    return (getattr(hf, "query_pre_attn_scalar", None) or head_dim_of(hf)) ** -0.5


def pick_dtype(name: str, device: str) -> tuple[torch.dtype, str]:
    """Resolve ``auto``: bf16 on GPUs, fp32 on CPUs.

    Measured on the project's CPU machines (docs/benchmarks.md): bf16 decode is
    several times slower than fp32 there (no native bf16 matmul on AVX2, and
    small-M bf16 linears are slow even with AMX), and the fused CPU kernels are fp32.
    """
    if name != "auto":
        return _DTYPES[name], "requested"
    if device.startswith("cuda"):
        return torch.bfloat16, "auto: GPU"
    cap = torch.backends.cpu.get_cpu_capability()
    return torch.float32, f"auto: fp32 is the faster decode dtype measured on CPU ({cap})"


def mixed_chunk_note(config: EngineConfig) -> str:
    """The start-up log's words on mixed chunks and the inter-token-latency budget."""
    if not config.enable_mixed_chunk:
        return "off (a prefill step stalls the running streams)"
    if config.itl_budget_ms:
        return (f"on, max_itl_ms={config.itl_budget_ms:g}: a step with streams riding takes "
                f"the prompt tokens its measured cost model predicts fit (up to "
                f"chunked_prefill_size={config.chunk_size})")
    return f"on, fixed chunks of chunked_prefill_size ({config.itl_budget_off_reason})"


class ModelRunner:
    """Owns the model, the KV pool, the request table and the attention backend.

    Limits computed here (pool size, request rows, context length) are exposed as
    attributes and logged once at start-up.
    """

    def __init__(self, config: EngineConfig, source: ModelSource, ep_rank: int = 0,
                 ep_init_method: str | None = None, tp_rank: int = 0,
                 tp_init_method: str | None = None):
        """``ep_rank`` / ``ep_init_method``: with ep_size > 1, this engine's rank and its
        group's rendezvous; ``self.ep`` is then its ExpertParallelGroup (engine/ep/group.py),
        joined once the options are known to suit the model. ``tp_rank`` /
        ``tp_init_method``: the same for tp_size > 1 (``self.tp``, engine/tp/); rank 0
        without a rendezvous starts its follower ranks as local processes."""
        # quantization="auto" becomes what runs here (engine/precision.py)
        config, self.precision_reason = resolve_precision(config, source.config)
        self.config = config
        self.device = config.device
        if self.device != "cpu" and not torch.cuda.is_available():
            raise RuntimeError(f"device={self.device!r} but torch sees no CUDA device "
                               f"(torch {torch.__version__}); use device='cpu'")
        if torch.device(self.device).index is not None:  # cuda:N: NCCL groups and CUDA
            torch.cuda.set_device(torch.device(self.device))  # graphs use the current device
        self.dtype, dtype_reason = pick_dtype(config.dtype, config.device)
        self.eplb = None  # the engine's ExpertBalancer (engine/ep/eplb.py) with enable_eplb
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        elif config.tp_size > 1:  # the group's ranks share this machine's cores
            torch.set_num_threads(max(1, torch.get_num_threads() // config.tp_size))
        self.num_threads = torch.get_num_threads()  # a forward thread of its own sets it too
        hf = source.config
        self.hf_config = hf
        self.vocab_size = hf.vocab_size
        self.context_len = config.context_length or hf.max_position_embeddings

        t0 = time.perf_counter()
        mem_before = available_memory_bytes(self.device)
        if config.deterministic:
            self.kernels = BatchInvariantKernels()
        else:
            self.kernels = CpuKernels(enabled=config.cpu_kernels and not self.device.startswith("cuda")
                                      and self.dtype == torch.float32)
        model_class = model_class_for(hf)
        expert_options = model_expert_options(config, model_class)  # refuses before joining
        check_tp_options(config, hf)  # refuses before joining
        self.ep = ep = join_ep_group(config, ep_rank, ep_init_method)
        if ep is not None:
            expert_options["ep_rank"] = ep.rank
        self.tp, self.tp_followers = join_tp_group(config, tp_rank, tp_init_method)
        if self.tp.size > 1:
            expert_options["tp"] = self.tp
        self.model = model_class(hf, self.dtype, max_positions=self.context_len,
                                 kernels=self.kernels, **expert_options)
        # MoE models record routes and expert load; a dense model's decode step skips it
        self.routes_experts = bool(getattr(self.model, "moe_blocks", None))
        self.model.load_weights(source.weights())
        self.quantized_layers = quantize_linears(self.model, config.quantization,
                                                 fused_ops=config.cpu_kernels)
        if config.quantize_lm_head:
            self.model.quantize_lm_head(fused_ops=config.cpu_kernels)
            self.quantized_layers += 1
        self.model.to(self.device).eval()
        self.lora = make_lora_slots(config, self.model, self.dtype, self.device)
        if self.device == "cpu":
            pack_parameters_into_huge_pages(self.model)
        load_s = self.weight_load_seconds = time.perf_counter() - t0

        head_dim = head_dim_of(hf)
        kv_heads = self.model.attention_layers()[0].num_kv_heads  # this rank's
        self.kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else _KV_DTYPES[config.kv_cache_dtype]
        self.bytes_per_token = kv_bytes_per_token(
            hf.num_hidden_layers, kv_heads, head_dim, self.kv_dtype)
        if config.max_total_tokens is not None:
            self.max_total_tokens = config.max_total_tokens
        else:
            mem_after = available_memory_bytes(self.device)
            budget = mem_after - (1.0 - config.mem_fraction_static) * mem_before
            if budget <= self.bytes_per_token:
                raise RuntimeError(
                    f"no memory left for the KV cache with mem_fraction_static="
                    f"{config.mem_fraction_static}: raise it or set max_total_tokens")
            self.max_total_tokens = int(budget // self.bytes_per_token)
        default_rows = min(max(int(self.max_total_tokens / self.context_len * 512), 2048), 4096)
        default_rows = speculative_running_rows(config, default_rows)
        self.max_running_requests = min(config.max_running_requests or default_rows,
                                        self.max_total_tokens)
        # every rank of a tensor-parallel group has the same slots and rows (the fewest)
        self.max_total_tokens, self.max_running_requests = self.tp.min_over_ranks(
            [self.max_total_tokens, self.max_running_requests])

        self.kv_pool = KVPool(self.max_total_tokens, hf.num_hidden_layers, kv_heads,
                              head_dim, self.kv_dtype, self.device, ext=self.kernels.ext)
        self.req_pool = ReqToTokenPool(self.max_running_requests, self.context_len)
        self.tp_mirror = DriverMirror(self.req_pool) if self.tp.size > 1 else None
        self.allocator = TokenSlotAllocator(self.max_total_tokens)
        scaling = attention_scaling(hf)
        backend = "cpu_batch_invariant" if config.deterministic else config.attention_backend
        self.attn_backend = create_attention_backend(
            backend, self.req_pool.table, self.kv_pool, scaling, self.dtype)
        for attn in self.model.attention_layers():
            attn.attn = self.attn_backend
        self.last_step_graphed = False  # the decode log line's "cuda graph"
        self.decode_graphs, graphs_note = build_decode_graphs(self, config)
        self.compiled_decode, compiled_note = build_compiled_decode(self, config)
        self.slot_routes = None  # enable_return_routed_experts (engine/models/routed_experts.py)
        if config.enable_return_routed_experts:
            moe = self.model.moe
            self.slot_routes = SlotRoutes(self.max_total_tokens + 1, len(moe.sparse_layers),
                                          moe.top_k, moe.num_experts)

        logger.info("precision: %s", self.precision_reason)
        logger.info(
            "Model %s loaded in %.1f s: dtype=%s (%s), quantization=%s (%d linear layers, lm_head %s), "
            "%d layers, %d kv heads, head_dim %d%s",
            (getattr(hf, "architectures", None) or ["?"])[0], load_s, str(self.dtype).removeprefix("torch."),
            dtype_reason, config.quantization, self.quantized_layers,
            "int8" if config.quantize_lm_head else "unquantized", hf.num_hidden_layers,
            hf.num_key_value_heads, head_dim, tp_summary(self.tp, self.model))
        logger.info(
            "KV cache: bytes_per_token=%d, max_total_num_tokens=%d, kv_cache_mb=%.1f, chunked_prefill_size=%s, "
            "max_prefill_tokens=%d, max_running_requests=%d, context_len=%d, kv_cache_dtype=%s, "
            "attention_backend=%s, cpu_kernels=%s, deterministic=%s, device=%s, threads=%d",
            self.bytes_per_token, self.max_total_tokens,
            self.bytes_per_token * self.max_total_tokens / 2**20, config.chunk_size,
            config.max_prefill_tokens, self.max_running_requests, self.context_len,
            str(self.kv_dtype).removeprefix("torch."), self.attn_backend.name, self.kernels.active,
            config.deterministic, self.device,
            torch.get_num_threads())
        logger.info("decode CUDA graphs: %s", graphs_note)
        logger.info("mixed chunked prefill: %s", mixed_chunk_note(config))
        if self.decode_graphs is not None:
            self.decode_graphs.capture_all()
        if config.device == "cpu":
            logger.info("compiled decode: %s", compiled_note)
        if self.compiled_decode is not None:
            self.compiled_decode.compile_all()

    # ---- batches ---------------------------------------------------------------------
    def build_extend_batch(self, items: list[tuple[Req, int]], slots: list[torch.Tensor]) -> ForwardBatch:
        """Prefill ``n`` new tokens of each request after its first ``kv_len`` tokens (and the
        rows of those that prompt logprobs need: engine/executor/prompt_logprobs.py)."""
        ids: list[int] = []
        positions: list[int] = []
        prefix_lens, extend_lens, seq_lens, captures = [], [], [], []
        for req, n in items:
            start = req.kv_len
            if self.routes_experts and req.sampling.return_routed_experts:
                captures.append((req, len(ids), n, start))
            ids.extend(req.all_ids[start:start + n])
            positions.extend(range(start, start + n))
            prefix_lens.append(start)
            extend_lens.append(n)
            seq_lens.append(start + n)
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            out_cache_loc=torch.cat(slots) if len(slots) > 1 else slots[0],
            req_rows=torch.tensor([r.req_row for r, _ in items], dtype=torch.int64),
            prefix_lens=prefix_lens, extend_lens=extend_lens, seq_lens=seq_lens,
            route_captures=captures, prompt_rows=plan_prompt_rows(items),
            lora=self._lora_batch([(r.lora, n) for r, n in items]))

    def build_decode_batch(self, reqs: list[Req], slots: torch.Tensor,
                           ahead: list[int] | None = None) -> ForwardBatch:
        """One new token per request: its last output token, at position ``kv_len``.
        ``ahead[i]`` (overlap scheduling): request ``i`` has that many tokens in a step in
        flight, so it runs ``ahead[i]`` positions on, its input filled in later (0 here)."""
        kv_lens = [r.kv_len for r in reqs]
        last = [r.output_ids[-1] for r in reqs]
        if ahead is not None:
            kv_lens = [n + a for n, a in zip(kv_lens, ahead)]
            last = [0 if a else t for t, a in zip(last, ahead)]
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.tensor(last, dtype=torch.int64),
            positions=torch.tensor(kv_lens, dtype=torch.int64),
            out_cache_loc=slots,
            req_rows=torch.tensor([r.req_row for r in reqs], dtype=torch.int64),
            prefix_lens=kv_lens, extend_lens=[1] * len(reqs), seq_lens=[n + 1 for n in kv_lens],
            route_captures=[(r, i, 1, n) for i, (r, n) in enumerate(zip(reqs, kv_lens))
                            if r.sampling.return_routed_experts] if self.routes_experts else [],
            lora=self._lora_batch([(r.lora, 1) for r in reqs], decode=True))

    def _lora_batch(self, row_adapters: list[tuple[str | None, int]], decode: bool = False):
        """The batch's LoraBatch (its adapters put in slots), or None without adapters."""
        return self.lora.batch(row_adapters, decode) if self.lora is not None else None

    def collect_routes(self, req: Req) -> None:
        """``req`` finishes (its slots not yet released): with enable_return_routed_experts and
        return_routed_experts, its routes become those of every token it holds in the KV,
        from position 0 (the cached prefix included)."""
        if (self.slot_routes is not None and req.sampling.return_routed_experts
                and req.req_row is not None and req.kv_len):
            self.slot_routes.collect(req, self.req_pool.table[req.req_row, :req.kv_len])

    def forward_idle(self) -> None:
        """Expert parallelism: this rank's part of a step another rank runs (no tokens). It
        counts as a forward pass for EPLB, so every rank of the group counts alike."""
        self.model.forward_idle()
        if self.eplb is not None:
            self.eplb.after_forward()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits ``[B, vocab]`` (on the model's device) for each request's last new token.
        Requests that asked for their routed experts get this step's (engine/models/routed_experts.py);
        those with prompt logprobs pending get this step's part of them appended."""
        if self.tp_mirror is not None:  # the followers run this pass with us
            self.tp.send(self.tp_mirror.message(batch))
        if self.device != "cpu":
            batch.to_device(self.device)
        logits = self.run_model(batch)
        if batch.prompt_rows is not None:
            compute_prompt_logprobs(batch.prompt_rows, self.model.project, self.vocab_size)
            batch.prompt_rows.hidden = None
        record_routes(batch)
        if self.slot_routes is not None and batch.routed_experts is not None:
            self.slot_routes.write(batch.out_cache_loc, batch.routed_experts)
        if self.eplb is not None:
            self.eplb.after_forward()
        return logits

    def model_changed(self) -> None:
        """A control call ran on the scheduler thread between steps (it may have swapped
        weights or buffers): compiled decode graphs check the model's guards again."""
        if self.compiled_decode is not None:
            self.compiled_decode.model_changed()

    def run_model(self, batch: ForwardBatch) -> torch.Tensor:
        """The model's forward over ``batch``: a decode batch through its CUDA graph bucket
        when one applies (engine/executor/cuda_graph.py), else eagerly. Every rank of a
        tensor-parallel group calls it with the same batch."""
        graphs = self.decode_graphs
        self.last_step_graphed = graphs is not None and graphs.can_run(batch)
        if self.last_step_graphed:
            return graphs.run(batch)
        compiled = self.compiled_decode
        if compiled is not None and compiled.can_run(batch):
            return compiled.run(batch)
        self.attn_backend.init_forward_metadata(batch)
        return self.model(batch)

    def facts(self) -> ModelFacts:
        """What measurements need to know of the served model (``Engine.model_facts``)."""
        c = self.config
        return ModelFacts(self.model, self.dtype, self.bytes_per_token, self.vocab_size,
                          self.precision_reason, c.quantization, c.kv_cache_dtype,
                          c.quantize_lm_head)

    def weights_moved(self) -> None:
        """The weights' or the KV pool's tensors changed (a weight update's commit or
        rollback, a memory release): captured graphs read the old addresses."""
        if self.decode_graphs is not None:
            self.decode_graphs.invalidate()

    def close(self) -> None:
        """Stop the follower ranks this runner drives (tensor parallelism); idempotent."""
        if self.tp_mirror is None or self.tp.rank != 0:
            return
        self.tp_mirror = None
        try:
            self.tp.send(Stop())
        except Exception:  # noqa: BLE001 - a follower already gone: nothing to stop
            logger.warning("could not tell the tensor-parallel followers to stop")
        if self.tp_followers is not None:
            self.tp_followers.stop()
        self.tp.leave()
