"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral.

They are the Llama-family decoder (``llama.py``: attention, norms, rotary) with a
sparse feed-forward block in some or all layers. A :class:`MoeSpec` reads what
differs between the architectures from the Hugging Face config; the block
(:class:`SparseMoeBlock`) routes with :class:`~.experts.TopKRouter`, maps logical
experts to physical slots through the model's :class:`~.expert_map.ExpertMap` and
hands the tokens to an :class:`~.experts.ExpertDispatcher`. With
``num_redundant_experts`` spare slots per layer the busy experts have copies there;
:meth:`MoeForCausalLM.apply_placement` moves them between forward passes (EPLB).

Every forward pass adds each MoE layer's chosen logical experts to per-expert token
counters (:meth:`MoeForCausalLM.expert_load`, the load a balancer plans from) and,
when a request of the batch asked (``ForwardBatch.route_captures``), leaves the
chosen ids of every token in ``batch.routed_experts``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from radixray.engine.ep.eplb_planner import ExpertPlacement
from radixray.engine.ep.expert_map import ExpertMap
from radixray.engine.ep.expert_moves import MoveStats, move_expert_weights
from radixray.engine.executor.forward_batch import ForwardBatch
from radixray.engine.models.experts import ExpertDispatcher, Gate, LocalExperts, TopKRouter
from radixray.engine.models.llama import LlamaForCausalLM, LlamaMLP
from radixray.engine.tp.group import NO_TP, TensorParallel
from radixray.kernels.cpu_ops import CpuKernels

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")


@dataclass(frozen=True)
class MoeSpec:
    """What a MoE architecture's config says about its sparse layers."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    renormalize: bool  # divide the top-k probabilities by their sum
    fp32_weights: bool  # routing weights stay fp32 (Mixtral) or take the logits' dtype
    shared_intermediate_size: int  # 0: no shared expert
    sparse_layers: tuple[int, ...]  # decoder layers whose feed-forward is the MoE block

    @classmethod
    def from_config(cls, config, max_positions: int) -> MoeSpec:
        """Read and check ``config``; ValueError names what this engine cannot run."""
        kind = config.model_type
        if kind not in MOE_MODEL_TYPES:
            raise ValueError(f"model_type {kind!r} is not a mixture-of-experts type this engine "
                             f"runs; supported: {MOE_MODEL_TYPES}")
        layers = range(config.num_hidden_layers)
        if kind == "mixtral":
            num_experts, inter = config.num_local_experts, config.intermediate_size
            renormalize, fp32_weights, shared, sparse = True, True, 0, tuple(layers)
        else:
            num_experts, inter = config.num_experts, config.moe_intermediate_size
            renormalize, fp32_weights = bool(config.norm_topk_prob), False
            shared = config.shared_expert_intermediate_size if kind == "qwen2_moe" else 0
            dense = set(config.mlp_only_layers or ())
            step = config.decoder_sparse_step
            if num_experts > 0 and step < 1:
                raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
            sparse = tuple(i for i in layers
                           if i not in dense and num_experts > 0 and (i + 1) % step == 0)
        top_k = config.num_experts_per_tok
        if sparse and not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}] (the expert "
                             f"count), got {top_k}")
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported: the experts "
                             f"and MLPs here are SwiGLU (hidden_act 'silu')")
        window = _sliding_window(config)
        if window is not None and window < max_positions:
            raise ValueError(f"sliding-window attention (sliding_window={window}) is not "
                             f"supported; run with context_length <= {window} or a config "
                             f"without a window")
        return cls(num_experts, top_k, inter, renormalize, fp32_weights, shared, sparse)


def _sliding_window(config) -> int | None:
    """The attention window the config puts on some layer, or None."""
    if config.model_type == "mixtral":
        return config.sliding_window
    if not getattr(config, "use_sliding_window", False):
        return None
    return config.sliding_window or None


class SparseMoeBlock(nn.Module):
    """Router -> logical-to-physical map -> experts (+ a gated shared expert).

    ``expert_map`` (shared by all MoE layers of the model) maps the routed logical
    experts of MoE layer ``moe_layer`` to physical slots; routing, the recorded ids and
    the load counters stay logical.
    """

    def __init__(self, config, spec: MoeSpec, kernels: CpuKernels, experts: ExpertDispatcher,
                 expert_map: ExpertMap, moe_layer: int, tp: TensorParallel = NO_TP):
        super().__init__()
        self.tp = tp  # tensor parallelism: each expert's share on this rank, one all-reduce
        hidden = config.hidden_size
        self.gate = TopKRouter(spec.num_experts, hidden, spec.top_k, spec.renormalize,
                               spec.fp32_weights, kernels)
        self.experts = experts
        self.expert_map = expert_map
        self.moe_layer = moe_layer
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_intermediate_size:
            self.shared_expert = LlamaMLP(config, kernels, spec.shared_intermediate_size, tp)
            self.shared_expert_gate = Gate(1, hidden, kernels)
        self.last_topk_ids: torch.Tensor | None = None  # [T, k] logical, read by the model

    def to_physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.expert_map.to_physical(topk_ids, self.moe_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate.route(x)
        self.last_topk_ids = ids
        out = self.experts.dispatch(x, self.to_physical(ids), weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.partial(x)
        return self.tp.all_reduce(out)


class MoeForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose ``spec.sparse_layers`` run a :class:`SparseMoeBlock`
    (the others a dense SwiGLU of ``intermediate_size``).

    ``num_redundant_experts``: spare physical slots per MoE layer for copies of busy
    experts (engine option ``ep_num_redundant_experts``). ``ep_rank`` / ``ep_size``: this
    process is rank ``ep_rank`` of an expert-parallel group and holds
    ``expert_map.local`` of the slots (``ep_size`` > 1 needs an expert-parallel
    dispatcher: :meth:`make_dispatcher`).
    """

    def __init__(self, config, dtype: torch.dtype = torch.float32, max_positions: int | None = None,
                 kernels: CpuKernels | None = None, *, num_redundant_experts: int = 0,
                 ep_rank: int = 0, ep_size: int = 1, ep_dispatch_backend: str = "collectives",
                 tp: TensorParallel = NO_TP):
        # Read before the layers are built: make_mlp needs them.
        self.moe = MoeSpec.from_config(config, max_positions or config.max_position_embeddings)
        if not self.moe.sparse_layers and (num_redundant_experts or ep_size > 1):
            raise ValueError(f"ep_num_redundant_experts / ep_size need routed experts; this "
                             f"{config.model_type} config has no sparse layer")
        self.ep_dispatch_backend = ep_dispatch_backend
        self.expert_map: ExpertMap | None = None  # None: no sparse layer, all dense
        if self.moe.sparse_layers:
            self.expert_map = ExpertMap.initial(len(self.moe.sparse_layers), self.moe.num_experts,
                                                num_redundant_experts, ep_rank, ep_size)
        super().__init__(config, dtype, max_positions, kernels, tp)
        self.moe_blocks: list[SparseMoeBlock] = [self.layers[i].mlp for i in self.moe.sparse_layers]
        self.register_buffer("expert_counts", torch.zeros(
            len(self.moe_blocks), self.moe.num_experts, dtype=torch.int64), persistent=False)

    def make_mlp(self, config, layer_id: int, kernels: CpuKernels) -> nn.Module:
        if layer_id in self.moe.sparse_layers:
            experts = self.make_dispatcher(config.hidden_size, kernels)
            return SparseMoeBlock(config, self.moe, kernels, experts, self.expert_map,
                                  self.moe.sparse_layers.index(layer_id), self.tp)
        return LlamaMLP(config, kernels, tp=self.tp)

    def make_dispatcher(self, hidden_size: int, kernels: CpuKernels) -> ExpertDispatcher:
        """The expert computation of one MoE layer, holding ``expert_map.local`` slots."""
        em = self.expert_map
        if em.ep_size > 1:
            from radixray.engine.ep.factory import make_expert_dispatcher
            return make_expert_dispatcher(self.ep_dispatch_backend, em.placement.num_physical,
                                          hidden_size, self.moe.intermediate_size, kernels,
                                          rank=em.ep_rank, world_size=em.ep_size)
        return LocalExperts(len(em.local), hidden_size, self.moe.intermediate_size // self.tp.size,
                            kernels)

    @torch.inference_mode()
    def forward_idle(self) -> None:
        """Expert parallelism, a rank with no tokens this step: join every MoE layer's
        exchange, in layer order, with an empty batch (engine/ep/group.py)."""
        k = self.moe.top_k
        for block in self.moe_blocks:
            dtype = block.experts.down_proj.dtype
            block.experts.dispatch(torch.empty(0, self.config.hidden_size, dtype=dtype),
                                   torch.empty(0, k, dtype=torch.int64),
                                   torch.empty(0, k, dtype=torch.float32))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        logits = super().forward(batch)
        ids = [block.last_topk_ids for block in self.moe_blocks]
        for block in self.moe_blocks:
            block.last_topk_ids = None
        if ids:
            stacked = torch.stack(ids, dim=1)  # [T, moe layers, k]
            # one bincount for all layers: layer i's experts count in bins [i*E, (i+1)*E)
            layers, experts = self.expert_counts.shape
            offsets = torch.arange(layers, device=stacked.device)[None, :, None] * experts
            self.expert_counts.view(-1).add_(
                torch.bincount((stacked + offsets).flatten(), minlength=layers * experts))
            batch.routed_experts = stacked  # for capturing requests and SlotRoutes
        return logits

    def expert_load(self, reset: bool = False) -> torch.Tensor:
        """Tokens routed to each logical expert ``[MoE layers, experts]`` (int64, CPU) since
        the start or the last reset; each token counts once per chosen expert. Row ``i``
        is decoder layer ``moe.sparse_layers[i]``. Read it between forward passes (on the
        scheduler thread). With ``enable_eplb`` the engine's balancer resets it after every
        pass and keeps the load in its window (``engine/ep/eplb.py``)."""
        counts = self.expert_counts.cpu().clone()
        if reset:
            self.expert_counts.zero_()
        return counts

    # ---- expert placement (EPLB) ------------------------------------------------------
    def apply_placement(self, new: ExpertPlacement) -> MoveStats:
        """Copy expert weights into the slots ``new`` assigns and route by it from now on;
        returns what moved on this rank. Scheduler thread, between forward passes, never
        during a weight-update session. Under expert parallelism every rank of the group
        calls it with the same ``new`` at the same point (weights cross between ranks:
        ``engine/ep/expert_moves.py``). Every copy is read before any is written, so a
        failure leaves the old placement and weights serving."""
        em = self.expert_map
        group = getattr(self.moe_blocks[0].experts, "group", None)
        stats = move_expert_weights(self.moe_blocks, em.transfers(new), em.ep_rank, em.ep_size,
                                    len(em.local), group)
        em.set(new)
        return stats

    def slot_experts(self, module_path: str) -> tuple[list[int], int]:
        """For the dispatcher at ``module_path`` (``layers.3.mlp.experts``): the logical expert
        each of its slots holds, and the number of logical experts (the weight layout
        writes a checkpoint expert into every slot holding it)."""
        block = self.get_submodule(module_path.removesuffix(".experts"))
        return self.expert_map.local_experts(block.moe_layer), self.moe.num_experts

    # ---- weight loading -------------------------------------------------------------
    def stacked_shards(self) -> dict[str, dict[str, tuple[tuple[str, int | None], ...]]]:
        """Parameters stacked over experts: ``experts.gate_up_proj[e]`` holds expert ``e``'s
        ``gate_proj`` then ``up_proj`` rows, ``experts.down_proj[e]`` its ``down_proj``
        (read by :class:`~radixray.engine.weights.layout.WeightLayout`)."""
        return {"experts": {"gate_up_proj": (("gate_proj", None), ("up_proj", None)),
                            "down_proj": (("down_proj", None),)}}

    def checkpoint_renames(self) -> tuple[tuple[str, str], ...]:
        """Mixtral checkpoints name the block ``block_sparse_moe`` and the expert projections
        w1 (gate), w3 (up), w2 (down); transformers renames them the same way on load."""
        if self.config.model_type != "mixtral":
            return ()
        return ((r"\.block_sparse_moe\.", ".mlp."), (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
                (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
                (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."))
