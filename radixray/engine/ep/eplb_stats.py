"""EPLB measures: the expert load over a sliding window, and how even it is over ranks.

:class:`ExpertLoadWindow` sums the tokens routed to each (layer, logical expert) over
the last W forward passes; its totals are what ``eplb_planner.plan`` balances.
:func:`balancedness` is the gauge: per layer, the mean over the max of the per-rank
load (1.0 = perfectly even), as SGLang reports ``eplb_balancedness``.
"""

from __future__ import annotations

import torch

from radixray.engine.ep.eplb_planner import ExpertPlacement, check_load


class ExpertLoadWindow:
    """Tokens routed to each (layer, logical expert), summed over the last ``window_size`` passes.

    A ring of ``window_size`` count tensors ``[num_layers, num_experts]``: :meth:`record`
    overwrites the oldest pass and keeps a running total, so :meth:`totals` costs one
    copy whatever the window. Before the window fills, the total covers the passes
    recorded so far. Memory is ``window_size * num_layers * num_experts`` int32.
    """

    def __init__(self, num_layers: int, num_experts: int, window_size: int):
        for name, value in (("num_layers", num_layers), ("num_experts", num_experts),
                            ("window_size", window_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self._ring = torch.zeros(window_size, num_layers, num_experts, dtype=torch.int32)
        self._total = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        self._next = 0
        self._recorded = 0

    @property
    def window_size(self) -> int:
        return self._ring.shape[0]

    @property
    def num_recorded(self) -> int:
        """Passes the window holds now: ``min(passes recorded, window_size)``."""
        return self._recorded

    def record(self, counts: torch.Tensor) -> None:
        """Add one forward pass's counts ``[num_layers, num_experts]`` (non-negative integers)."""
        if tuple(counts.shape) != tuple(self._total.shape):
            raise ValueError(f"counts has shape {tuple(counts.shape)}, expected "
                             f"[num_layers, num_experts] = {list(self._total.shape)}")
        counts = counts.detach().to("cpu", torch.int64)
        if bool((counts < 0).any()):
            raise ValueError("counts must be >= 0")
        self._total -= self._ring[self._next]
        self._ring[self._next] = counts
        self._total += counts
        self._next = (self._next + 1) % self.window_size
        self._recorded = min(self._recorded + 1, self.window_size)

    def totals(self) -> torch.Tensor:
        """Token counts ``[num_layers, num_experts]`` (int64) over the passes in the window."""
        return self._total.clone()

    def reset(self) -> None:
        self._ring.zero_()
        self._total.zero_()
        self._next = self._recorded = 0


def rank_load(load: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """Per-rank load ``[layers, num_ranks]`` (float64): each copy carries ``load / copies``,
    which is what :meth:`ExpertPlacement.to_physical` gives on average."""
    load = check_load(load)
    if tuple(load.shape) != (placement.num_layers, placement.num_logical):
        raise ValueError(f"load has shape {tuple(load.shape)}, expected [layers, num_logical] = "
                         f"[{placement.num_layers}, {placement.num_logical}] of the placement")
    p2l = placement.physical_to_logical.cpu()
    per_copy = (load / placement.logical_count.cpu()).gather(1, p2l)
    return per_copy.view(placement.num_layers, placement.num_ranks, -1).sum(-1)


def balancedness(load: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """Per layer ``[layers]``: mean over max of :func:`rank_load`; 1.0 when perfectly even
    (and for a layer with no load), ``1 / num_ranks`` when one rank takes it all."""
    ranks = rank_load(load, placement)
    top = ranks.max(-1).values
    return torch.where(top > 0, ranks.mean(-1) / top.clamp(min=1e-30), torch.ones_like(top))


def overall_balancedness(load: torch.Tensor, placement: ExpertPlacement) -> float:
    """The gauge: :func:`balancedness` averaged over layers."""
    return float(balancedness(load, placement).mean())
