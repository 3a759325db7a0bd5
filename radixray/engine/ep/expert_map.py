"""Which physical slot holds which logical expert, and which slots this process holds.

A MoE model with ``num_redundant`` spare slots per layer keeps ``num_logical +
num_redundant`` physical expert slots; an :class:`~radixray.engine.ep.eplb_planner.ExpertPlacement`
says which logical expert each slot holds (copies of the busy ones fill the spare
slots). Under expert parallelism the slots are split evenly over ``ep_size`` ranks and
rank ``ep_rank`` holds ``local`` of them; at ``ep_size`` 1 it holds them all.

:class:`ExpertMap` is the one place that knows both: every MoE layer of a model
routes through it (:meth:`ExpertMap.to_physical`), the weight layout asks it which
local slots take a checkpoint's expert (:meth:`ExpertMap.local_experts`), and a
rebalance asks it where each new slot's weights come from (:meth:`ExpertMap.transfers`).

The planner balances load over ``num_ranks`` of the placement: the EP ranks, or at
``ep_size`` 1 every slot on its own (:func:`planning_ranks`). One process computes
every slot then, so no rank waits for another; balancing per slot still spreads a
hot expert's tokens over its copies and measures what an EP group of one slot per
rank would see, and it is the same code path that ``ep_size`` > 1 runs.
"""

from __future__ import annotations

import torch

from radixray.engine.ep.eplb_planner import ExpertPlacement, plan


def planning_ranks(num_physical: int, ep_size: int) -> int:
    """The ranks a placement balances over: the EP ranks, or each slot when ``ep_size`` is 1."""
    return ep_size if ep_size > 1 else num_physical


class ExpertMap:
    """The current placement of one model's MoE layers (row ``i``: the ``i``-th MoE layer)
    and the slots of this EP rank. Shared by the model and its blocks; :meth:`set` swaps
    the placement, on the scheduler thread between forward passes."""

    def __init__(self, placement: ExpertPlacement, ep_rank: int = 0, ep_size: int = 1):
        if ep_size < 1 or not 0 <= ep_rank < ep_size:
            raise ValueError(f"ep_rank must be in [0, ep_size={ep_size}), got {ep_rank}")
        if placement.num_physical % ep_size:
            raise ValueError(f"num_physical ({placement.num_physical}) must be divisible by "
                             f"ep_size ({ep_size})")
        self.ep_rank, self.ep_size = ep_rank, ep_size
        per_rank = placement.num_physical // ep_size
        self.local = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
        self.version = 0  # bumped by every set(): layouts built on an older one are stale
        self._placement = placement
        self._on_device: dict[torch.device, ExpertPlacement] = {}

    @classmethod
    def initial(cls, num_layers: int, num_logical: int, num_redundant: int = 0,
                ep_rank: int = 0, ep_size: int = 1) -> ExpertMap:
        """The start-up placement: one copy per expert, and with ``num_redundant`` spare slots
        the planner's answer for an even load (deterministic: the spare copies go to the
        lowest expert ids). ValueError names ``ep_num_redundant_experts`` and its bound."""
        if num_redundant < 0:
            raise ValueError(f"ep_num_redundant_experts must be >= 0, got {num_redundant}")
        num_physical = num_logical + num_redundant
        if ep_size < 1 or num_physical % ep_size:
            raise ValueError(f"ep_num_redundant_experts: num_experts ({num_logical}) + "
                             f"ep_num_redundant_experts ({num_redundant}) must be divisible "
                             f"by ep_size ({ep_size})")
        ranks = planning_ranks(num_physical, ep_size)
        if num_redundant == 0:
            placement = ExpertPlacement.identity(num_layers, num_logical, ranks)
        else:
            try:
                placement = plan(torch.ones(num_layers, num_logical), ranks,
                                 num_redundant=num_redundant)
            except ValueError as exc:
                raise ValueError(f"ep_num_redundant_experts={num_redundant} is out of range "
                                 f"for {num_logical} experts on ep_size {ep_size}: {exc}") from None
        return cls(placement, ep_rank, ep_size)

    @property
    def placement(self) -> ExpertPlacement:
        return self._placement

    def set(self, placement: ExpertPlacement) -> None:
        """Route by ``placement`` from now on (same layers, experts, slots and ranks)."""
        old = self._placement
        if (placement.num_layers, placement.num_logical, placement.num_physical,
                placement.num_ranks) != (old.num_layers, old.num_logical, old.num_physical,
                                         old.num_ranks):
            raise ValueError("a new placement must keep [layers, num_logical, num_physical, "
                             "num_ranks] of the model's")
        self._placement = placement
        self._on_device.clear()
        self.version += 1

    def to_physical(self, topk_ids: torch.Tensor, layer: int) -> torch.Tensor:
        """Routed logical ids ``[T, k]`` of MoE layer ``layer`` -> physical slots (see
        :meth:`ExpertPlacement.to_physical`; this rank's number spreads single tokens)."""
        placement = self._on_device.get(topk_ids.device)
        if placement is None:
            placement = self._on_device[topk_ids.device] = self._placement.to(topk_ids.device)
        if placement.num_redundant == 0:  # one copy each: a lookup
            return placement.logical_to_physical[layer, :, 0][topk_ids]
        return placement.to_physical(topk_ids, layer, offset=self.ep_rank)

    def local_experts(self, layer: int, placement: ExpertPlacement | None = None) -> list[int]:
        """The logical expert each local slot of MoE layer ``layer`` holds, in slot order."""
        p2l = (placement or self._placement).physical_to_logical[layer]
        return p2l[self.local.start:self.local.stop].tolist()

    def transfers(self, new: ExpertPlacement) -> list[list[tuple[int, int]]]:
        """Per MoE layer, ``(destination, source)`` *physical* slots whose weights must be
        copied to go from the current placement to ``new``, for every rank of the group
        (slots that keep their expert are left out), in increasing destination order.

        The source holds the destination's new expert now: a slot on the destination's
        own rank when there is one (a local copy), else the lowest-numbered slot holding
        it (a copy from another rank). Every rank computes the same list from the same
        two placements, so all of them know who sends what to whom without asking.
        """
        old = self._placement
        per_rank = len(self.local)  # slots per EP rank (all of them at ep_size 1)
        out = []
        for layer in range(new.num_layers):
            was = old.physical_to_logical[layer].tolist()
            now = new.physical_to_logical[layer].tolist()
            holders: dict[int, list[int]] = {}
            for slot, expert in enumerate(was):
                holders.setdefault(expert, []).append(slot)
            pairs = []
            for slot, expert in enumerate(now):
                if was[slot] == expert:
                    continue
                rank = slot // per_rank
                held = holders[expert]
                pairs.append((slot, next((s for s in held if s // per_rank == rank), held[0])))
            out.append(pairs)
        return out
