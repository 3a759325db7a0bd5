"""MoE routing replay (R3): the trainer's forward uses the experts the rollout routed to.

A mixture-of-experts router picks each token's top-k experts from its logits; the
rollout's engine and the trainer compute those logits with different kernels, so a token
whose k-th and (k+1)-th experts are close can take another expert in training than it did
in the rollout. Its logprob then differs (the rollout/train mismatch of MoE models) and
its gradient flows through experts that never produced the sample. Replaying the routes
removes both: the engine returns every token's top-k logical expert ids
(``return_routed_experts``, ``meta_info["routed_experts"]``: [token][MoE layer][k] for
positions ``routed_experts_start ..``; engine/models/routed_experts.py), and
:class:`RoutingReplay` makes the transformers MoE blocks use them.

Only the *choice* is replayed. The weights of the chosen experts are still the softmax of
the router's logits gathered at the replayed ids (renormalised over them when the model
does: ``norm_topk_prob``, always for Mixtral), so the router keeps receiving gradient.
Tokens without a route (padding, each sequence's last token, a cached prefix the engine
did not cover) keep the model's own routing: they are masked out or, for an uncovered
prefix, the best the trainer can do.

Implementation: a forward hook on each block's router (``Qwen3MoeTopKRouter`` and the
Qwen2-MoE and Mixtral ones in transformers 5, which return ``(router_logits, weights,
ids)`` to the block, which hands the ids and weights to its experts module, whatever its
``experts_implementation``). The hooks live only inside the ``with`` block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

# The transformers MoE blocks replayed: those of the architectures the engine runs
# (engine/models/moe.py MOE_MODEL_TYPES); each has a ``gate`` router returning
# (router_logits [T, E], weights [T, k], ids [T, k]) for its flattened [B * L, H] input.
MOE_BLOCK_CLASSES = ("Qwen3MoeSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "MixtralSparseMoeBlock")


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The router of every sparse MoE block in ``model`` (or ``model`` itself being one), in
    module order: decoder layer order, the order of the engine's MoE layer index."""
    return [m.gate for m in model.modules() if type(m).__name__ in MOE_BLOCK_CLASSES]


def pad_routes(samples: Sequence[dict], length: int, num_layers: int, top_k: int) -> torch.Tensor:
    """The samples' ``routed_experts`` laid out like ``trainer.pad_batch``'s ``tokens``:
    int64 ``[MoE layers, B, length, k]``, -1 where a position has no route (a sample without
    the key, positions before its ``routed_experts_start`` (default 0), its last token,
    padding). ValueError when a sample's routes do not fit the model or its sequence."""
    out = torch.full((num_layers, len(samples), length, top_k), -1, dtype=torch.int64)
    for i, s in enumerate(samples):
        routes = s.get("routed_experts")
        if not routes:
            continue
        start = int(s.get("routed_experts_start") or 0)
        ids = torch.tensor(routes, dtype=torch.int64)
        n_seq = len(s["prompt_ids"]) + len(s["output_ids"])
        if ids.dim() != 3 or tuple(ids.shape[1:]) != (num_layers, top_k):
            raise ValueError(f"samples[{i}]['routed_experts'] has shape {tuple(ids.shape)}; this "
                             f"model needs [tokens, {num_layers} MoE layers, top-k {top_k}]")
        if start < 0 or start + ids.shape[0] > n_seq:
            raise ValueError(f"samples[{i}]: routes for positions {start}..{start + len(ids) - 1} "
                             f"but the sequence has {n_seq} tokens")
        out[:, i, start:start + ids.shape[0]] = ids.transpose(0, 1)
    return out


def batch_routes(model: nn.Module, samples: Sequence[dict], length: int,
                 device=None) -> torch.Tensor | None:
    """:func:`pad_routes` for ``model``'s MoE layers, or None when there is nothing to replay
    (a dense model, or no sample carries ``routed_experts``)."""
    routers = moe_routers(model)
    if not routers or not any(s.get("routed_experts") for s in samples):
        return None
    routes = pad_routes(samples, length, len(routers), routers[0].top_k)
    num_experts = routers[0].num_experts
    if int(routes.max()) >= num_experts:
        raise ValueError(f"routed_experts holds expert id {int(routes.max())}; the model has "
                         f"{num_experts} experts")
    return routes if device is None else routes.to(device)


class RoutingReplay:
    """``with RoutingReplay(model, routes):`` forwards of ``model`` on the batch ``routes``
    was built for (``[MoE layers, B, L, k]``, :func:`batch_routes`) route every position
    with an id (>= 0) to those experts. ``routes`` None: a no-op. ``force=False`` only
    counts the flips (a measurement of what replay would change).

    After the block, :attr:`replayed` counts the (token, MoE layer) pairs that had a route
    and :attr:`flips` those where the model's own top-k set differed from it. The backward
    may run after the block (autograd keeps the replayed ids), unless the model recomputes
    its forward in backward (activation checkpointing): then run the backward inside."""

    def __init__(self, model: nn.Module, routes: torch.Tensor | None, force: bool = True):
        self.model = model
        self.routes = routes
        self.force = force
        self._handles: list = []
        self._replayed: list[torch.Tensor] = []
        self._flips: list[torch.Tensor] = []

    def __enter__(self) -> RoutingReplay:
        if self.routes is None:
            return self
        routers = moe_routers(self.model)
        if len(routers) != self.routes.shape[0]:
            raise ValueError(f"routes for {self.routes.shape[0]} MoE layers; the model has "
                             f"{len(routers)}")
        self._handles = [r.register_forward_hook(self._hook(layer))
                         for layer, r in enumerate(routers)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def replayed(self) -> int:
        return int(sum(int(x) for x in self._replayed))

    @property
    def flips(self) -> int:
        return int(sum(int(x) for x in self._flips))

    def _hook(self, layer: int):
        def hook(router: nn.Module, args, output):
            if not (isinstance(output, tuple) and len(output) == 3):
                raise TypeError(f"{type(router).__name__} returned {type(output).__name__}; "
                                "routing replay expects (router_logits, weights, ids)")
            logits, weights, own = output
            forced = self.routes[layer].reshape(-1, own.shape[-1]).to(own.device)
            if forced.shape != own.shape:
                raise ValueError(f"routes for {forced.shape[0]} tokens, the MoE layer got "
                                 f"{own.shape[0]}: build them for this batch's [B, L]")
            has = (forced >= 0).all(dim=-1)
            with torch.no_grad():
                differs = (own.sort(dim=-1).values != forced.sort(dim=-1).values).any(dim=-1)
                self._replayed.append(has.sum())
                self._flips.append((has & differs).sum())
            if not self.force:
                return None
            ids = torch.where(has[:, None], forced, own)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            chosen = probs.gather(1, ids)
            if getattr(router, "norm_topk_prob", True):  # Mixtral's router always renormalises
                chosen = chosen / chosen.sum(dim=-1, keepdim=True)
            return logits, chosen.to(weights.dtype), ids
        return hook
