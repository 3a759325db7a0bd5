"""Llama-family dense decoder: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (per-head q/k norm).

With tensor parallelism (``tp``, engine/tp/) each rank builds the layers at its local sizes
(its query and KV heads, its share of the intermediate size and of the vocabulary, as
engine/tp/sharding.py says) and sums the row-parallel outputs and gathers the logits
through ``tp``; with one rank those collectives are no-ops.

Projections are fused (q|k|v into one matmul, gate|up into another) so a decode
step launches as few ops as possible; ``load_weights`` maps Hugging Face
parameter names onto the fused shards. The feed-forward block of each layer comes
from :meth:`LlamaForCausalLM.make_mlp`, which the mixture-of-experts models
(``moe.py``) override.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from radixray.engine.executor.forward_batch import ForwardBatch, ForwardMode
from radixray.engine.models.layers import RMSNorm, RotaryEmbedding, VocabParallelEmbedding
from radixray.engine.tp.group import NO_TP, TensorParallel
from radixray.engine.tp.sharding import TPShard
from radixray.kernels.cpu_ops import CpuKernels, reference_kernels
from radixray.kernels.int8_linear import Int8Linear


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int, rotary: RotaryEmbedding, kernels: CpuKernels,
                 tp: TensorParallel = NO_TP):
        super().__init__()
        self.kernels = kernels
        self.layer_id = layer_id
        self.tp = tp
        shard = TPShard.of(config, tp.rank, tp.size)
        self.num_heads = shard.local_heads  # this rank's (all of them with one rank)
        self.num_kv_heads = shard.local_kv_heads
        self.head_dim = shard.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # attention_bias (Llama, Qwen3, Qwen3-MoE) biases all four projections; Qwen2 and
        # Qwen2-MoE (qkv_bias) bias q, k and v only.
        o_bias = bool(getattr(config, "attention_bias", False))
        bias = o_bias or bool(getattr(config, "qkv_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.rotary = rotary
        # Qwen3 (dense and MoE) normalises each query and key head before rotation.
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels)
        self.attn = None  # set by the model runner: an AttentionBackend

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = (self.kernels.project(x, self.qkv_proj) if batch.lora is None
               else batch.lora.project("qkv", self.layer_id, self.qkv_proj, x, self.kernels))
        n_qk = self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, n_qk, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads:])), 1)
        qk = self.rotary(positions, qk, self.kernels)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        out = self.attn.forward(q, k, v, self.layer_id, batch).reshape(-1, self.q_size).to(x.dtype)
        y = (self.kernels.project(out, self.o_proj) if batch.lora is None
             else batch.lora.project("o", self.layer_id, self.o_proj, out, self.kernels))
        return self.tp.all_reduce(y)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward; ``intermediate_size`` overrides the config's (a shared expert).
    With ``tp``: this rank's share of the intermediate size, the output summed over ranks."""

    def __init__(self, config, kernels: CpuKernels, intermediate_size: int | None = None,
                 tp: TensorParallel = NO_TP):
        super().__init__()
        self.kernels = kernels
        self.tp = tp
        self.inter = (intermediate_size or config.intermediate_size) // tp.size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output (the output itself with one rank)."""
        return self.kernels.gated_mlp(x, self.gate_up_proj, self.down_proj)

    def forward_lora(self, x: torch.Tensor, lora, layer_id: int) -> torch.Tensor:
        """:meth:`forward` with each row's LoRA update (``lora``: the batch's LoraBatch) on
        gate|up and down; the two projections run apart (no fused gated-MLP kernel)."""
        k = self.kernels
        h = k.silu_mul(lora.project("gate_up", layer_id, self.gate_up_proj, x, k))
        return self.tp.all_reduce(lora.project("down", layer_id, self.down_proj, h, k))


class LlamaDecoderLayer(nn.Module):
    """Attention then ``mlp``: any module mapping normed hidden states ``[T, H]`` to ``[T, H]``
    (dense SwiGLU, or a mixture-of-experts block)."""

    def __init__(self, config, layer_id: int, rotary: RotaryEmbedding, kernels: CpuKernels,
                 mlp: nn.Module, tp: TensorParallel = NO_TP):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.self_attn = LlamaAttention(config, layer_id, rotary, kernels, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.mlp = mlp

    def forward(self, positions, x, batch, residual=None):
        """The residual stream kept apart: returns ``(mlp output, residual)``, whose sum is the
        layer's output; the next layer's input norm adds them in the same pass (first layer:
        ``residual`` None, ``x`` the embeddings)."""
        if residual is None:
            residual, normed = x, self.input_layernorm(x)
        else:
            residual, normed = self.input_layernorm.add_norm(x, residual)
        attn = self.self_attn(positions, normed, batch)
        residual, normed = self.post_attention_layernorm.add_norm(attn, residual)
        if batch.lora is not None:  # LoRA serves dense models only (engine/weights/lora_slots.py)
            return self.mlp.forward_lora(normed, batch.lora, self.self_attn.layer_id), residual
        return self.mlp(normed), residual


class LlamaForCausalLM(nn.Module):
    """Decoder over packed tokens; ``forward`` returns fp32 logits of each request's last new
    token (of every new token when ``batch.all_logits``), and keeps the hidden states of
    ``batch.prompt_rows`` for :meth:`project`."""

    def __init__(self, config, dtype: torch.dtype = torch.float32, max_positions: int | None = None,
                 kernels: CpuKernels | None = None, tp: TensorParallel = NO_TP):
        super().__init__()
        self.config = config
        self.kernels = kernels = kernels or reference_kernels()
        self.tp = tp
        self.tp_shard = shard = TPShard.of(config, tp.rank, tp.size)
        max_positions = max_positions or config.max_position_embeddings
        self.rotary = RotaryEmbedding(config, shard.head_dim, max_positions, dtype)
        self.embed_tokens = VocabParallelEmbedding(shard, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary, kernels, self.make_mlp(config, i, kernels),
                              tp)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, shard.local_vocab, bias=False)
        self.lm_head_int8: Int8Linear | None = None  # set by quantize_lm_head
        self.to(dtype)

    def make_mlp(self, config, layer_id: int, kernels: CpuKernels) -> nn.Module:
        """The feed-forward block of layer ``layer_id`` (called once per layer while the
        constructor builds them)."""
        return LlamaMLP(config, kernels, tp=self.tp)

    def quantize_lm_head(self, fused_ops: bool = True) -> None:
        """Run the logits projection as an int8 GEMM from now on (``Int8Linear`` over a
        copy of the head's weight; the fp32 weight stays, the embedding may share it)."""
        self.lm_head_int8 = Int8Linear(self.lm_head_weight.data, None, fused_ops=fused_ops)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def attention_layers(self) -> list[LlamaAttention]:
        return [layer.self_attn for layer in self.layers]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.logits(batch)

    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """:meth:`forward` without entering inference mode: what torch.compile traces (its
        caller is in inference mode already; engine/executor/compiled_decode.py)."""
        x, residual = self.embed_tokens(batch.input_ids), None
        for layer in self.layers:
            x, residual = layer(batch.positions, x, batch, residual)
        if batch.mode is not ForwardMode.DECODE and not batch.all_logits:
            if batch.prompt_rows is not None:  # prompt logprobs: projected by the runner
                keep = batch.prompt_rows.rows.to(x.device)
                batch.prompt_rows.hidden = self.norm.add_norm(x[keep], residual[keep])[1]
            rows = batch.last_token_rows()
            x, residual = x[rows], residual[rows]
        _, h = self.norm.add_norm(x, residual)
        return self.project(h)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` of final normed hidden states ``h`` ``[N, hidden]`` (with
        tensor parallelism every rank calls it: each projects its vocabulary rows and the
        logits are gathered)."""
        if self.lm_head_int8 is not None:
            logits = self.lm_head_int8(h).float()
        else:
            logits = self.kernels.linear(h, self.lm_head_weight).float()
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits)[:, :self.config.vocab_size]

    # ---- weight loading -------------------------------------------------------------
    def fused_shards(self) -> dict[str, tuple[tuple[str, int | None], ...]]:
        """Fused projection -> the Hugging Face projections stacked in it, in row order with
        their row counts (read by :class:`~radixray.engine.weights.layout.WeightLayout`; None:
        an equal share of the rows the counted parts leave, as gate and up split a fused
        projection whose width differs between dense layers and shared experts)."""
        attn0 = self.layers[0].self_attn
        q, kv = attn0.q_size, attn0.kv_size
        return {"qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
                "gate_up_proj": (("gate_proj", None), ("up_proj", None))}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters. ValueError names an
        unknown tensor, a wrong shape, or the tensors a full checkpoint lacks."""
        from radixray.engine.weights.layout import WeightLayout, WeightStage
        stage = WeightStage(WeightLayout(self), live=True)
        stage.add_all(weights)
        stage.check_complete()
