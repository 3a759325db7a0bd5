"""Expert-parallel load balancing (EPLB): which rank holds which MoE expert.

An MoE layer has ``num_logical`` experts, the model's own. Under expert parallelism
``num_ranks`` ranks each hold ``slots_per_rank`` *physical* experts (slots), so
``num_physical = num_logical + num_redundant``: the spare slots hold extra copies of
the busiest experts, and a token routed to a logical expert is sent to one of its
copies. Real traffic is skewed, and the rank holding the hot experts sets the pace
of every step; the planner moves experts so that each rank gets about the same load.

- :class:`ExpertPlacement` is the map in both directions, and
  :meth:`ExpertPlacement.to_physical` sends routed tokens to copies.
- :func:`plan` turns a load (``eplb_stats.ExpertLoadWindow.totals()``) into a new
  placement; :func:`keep_in_place` renumbers it so that experts stay where they are
  when they may; :func:`moves` counts the expert weights that must travel to apply it.

The measures (the load window, ``balancedness``) are in ``eplb_stats``. Pure Python and
torch on the CPU: no Ray, no model. Ranks are numbered node-major: rank ``r`` is on
node ``r // (num_ranks // num_nodes)``; slot ``s`` is on rank ``s // slots_per_rank``.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    """Where every copy of every logical expert lives, per MoE layer.

    - ``physical_to_logical[layer, slot]``: the logical expert slot ``slot`` holds
      (``[layers, num_physical]``, int64); slot ``s`` is on rank ``s // slots_per_rank``.
    - ``logical_to_physical[layer, e, i]``: the slot of copy ``i`` of expert ``e``, slots
      ascending, ``-1`` past ``logical_count[layer, e]`` (``[layers, num_logical, max_copies]``).
    - ``logical_count[layer, e]``: how many copies expert ``e`` has (>= 1).

    Build one with :meth:`from_physical_to_logical`, :meth:`identity` or :func:`plan`,
    which keep the three consistent; :meth:`validate` checks a hand-made one.
    """

    physical_to_logical: torch.Tensor
    logical_to_physical: torch.Tensor
    logical_count: torch.Tensor
    num_ranks: int

    @classmethod
    def from_physical_to_logical(cls, physical_to_logical: torch.Tensor, num_logical: int,
                                 num_ranks: int) -> ExpertPlacement:
        """Derive the other two maps from ``physical_to_logical``; ValueError if it is invalid."""
        p2l = torch.as_tensor(physical_to_logical).to("cpu", torch.int64)
        p2l = p2l.clone(memory_format=torch.contiguous_format)  # never alias the caller's
        if p2l.dim() != 2:
            raise ValueError(f"physical_to_logical must be 2-D [layers, num_physical], "
                             f"got shape {tuple(p2l.shape)}")
        _check_expert_ids(p2l, num_logical)
        layers, num_physical = p2l.shape
        count = torch.zeros(layers, num_logical, dtype=torch.int64)
        count.scatter_add_(1, p2l, torch.ones_like(p2l))
        # Slots sorted by (expert, slot); a slot's rank within its expert's run is its copy index.
        order = torch.argsort(p2l * num_physical + torch.arange(num_physical), dim=1)
        expert = p2l.gather(1, order)
        first = count.cumsum(1) - count
        copy = torch.arange(num_physical) - first.gather(1, expert)
        l2p = torch.full((layers, num_logical, max(int(count.max()), 1)), -1, dtype=torch.int64)
        l2p[torch.arange(layers)[:, None], expert, copy] = order
        placement = cls(p2l, l2p, count, num_ranks)
        placement.validate()
        return placement

    @classmethod
    def identity(cls, num_layers: int, num_logical: int, num_ranks: int) -> ExpertPlacement:
        """One copy per expert, split contiguously: rank ``r`` holds experts
        ``[r * num_logical / num_ranks, (r + 1) * num_logical / num_ranks)``."""
        if num_ranks < 1 or num_logical % num_ranks:
            raise ValueError(f"num_logical ({num_logical}) must be divisible by num_ranks "
                             f"({num_ranks})")
        p2l = torch.arange(num_logical).expand(num_layers, num_logical)
        return cls.from_physical_to_logical(p2l, num_logical, num_ranks)

    @property
    def num_layers(self) -> int:
        return self.physical_to_logical.shape[0]

    @property
    def num_physical(self) -> int:
        return self.physical_to_logical.shape[1]

    @property
    def num_logical(self) -> int:
        return self.logical_count.shape[1]

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_logical

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    def rank_of_slot(self, slot: int) -> int:
        if not 0 <= slot < self.num_physical:
            raise ValueError(f"slot must be in [0, {self.num_physical}), got {slot}")
        return slot // self.slots_per_rank

    def slots_on_rank(self, rank: int) -> range:
        """The physical slots rank ``rank`` holds, the same in every layer."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be in [0, {self.num_ranks}), got {rank}")
        return range(rank * self.slots_per_rank, (rank + 1) * self.slots_per_rank)

    def to(self, device: torch.device | str) -> ExpertPlacement:
        """The same placement with its tensors on ``device`` (for :meth:`to_physical` there)."""
        return ExpertPlacement(self.physical_to_logical.to(device),
                               self.logical_to_physical.to(device),
                               self.logical_count.to(device), self.num_ranks)

    def to_physical(self, topk_ids: torch.Tensor, layer: int, offset: int = 0) -> torch.Tensor:
        """Map routed logical expert ids ``[T, k]`` to physical slots of the same shape.

        The j-th occurrence of expert ``e`` in ``topk_ids`` (row-major) goes to copy
        ``(j + offset) % logical_count[layer, e]``, so within one call the copies of an
        expert get token counts that differ by at most one. Pass the attention-DP rank
        as ``offset`` so that ranks with one token each do not all pick copy 0.
        Pure tensor ops, on ``topk_ids``'s device (move the placement there first with
        :meth:`to`); ids must lie in ``[0, num_logical)``, and are not checked here.
        """
        ids = topk_ids.reshape(-1).long()
        order = torch.argsort(ids, stable=True)
        seen = torch.bincount(ids, minlength=self.num_logical)
        first = seen.cumsum(0) - seen
        occurrence = torch.empty_like(ids)
        occurrence[order] = torch.arange(ids.numel(), device=ids.device) - first[ids[order]]
        copy = (occurrence + offset) % self.logical_count[layer, ids]
        return self.logical_to_physical[layer, ids, copy].view(topk_ids.shape)

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistency; return None if the maps agree."""
        p2l, l2p, count = self.physical_to_logical, self.logical_to_physical, self.logical_count
        if p2l.dim() != 2 or count.dim() != 2 or l2p.dim() != 3:
            raise ValueError("physical_to_logical and logical_count must be 2-D and "
                             "logical_to_physical 3-D")
        layers, num_physical = p2l.shape
        num_logical = count.shape[1]
        if count.shape[0] != layers or tuple(l2p.shape[:2]) != (layers, num_logical):
            raise ValueError(f"logical_count {tuple(count.shape)} and logical_to_physical "
                             f"{tuple(l2p.shape)} disagree with physical_to_logical "
                             f"{tuple(p2l.shape)} on [layers, num_logical]")
        if self.num_ranks < 1 or num_physical % self.num_ranks:
            raise ValueError(f"num_physical ({num_physical}) must be divisible by num_ranks "
                             f"({self.num_ranks})")
        _check_expert_ids(p2l, num_logical)
        expected = torch.zeros_like(count).scatter_add_(1, p2l, torch.ones_like(p2l))
        _first_bad(count != expected, "logical_count[{}, {}] disagrees with physical_to_logical")
        _first_bad(count < 1, "logical expert {1} of layer {0} has no physical copy")
        if l2p.shape[2] < int(count.max()):
            raise ValueError(f"logical_to_physical has room for {l2p.shape[2]} copies, "
                             f"an expert has {int(count.max())}")
        arange = functools.partial(torch.arange, device=p2l.device)
        listed = arange(l2p.shape[2]) < count[..., None]
        _first_bad((l2p >= 0) != listed,
                   "logical_to_physical[{}, {}] is not padded with -1 exactly past logical_count")
        slots = l2p.clamp(0, num_physical - 1)
        held = p2l.gather(1, slots.flatten(1)).view_as(l2p)
        _first_bad(listed & ((l2p >= num_physical) | (held != arange(num_logical)[:, None])),
                   "logical_to_physical[{}, {}] lists a slot holding another expert")
        _first_bad(listed[..., 1:] & (slots[..., 1:] <= slots[..., :-1]),
                   "logical_to_physical[{}, {}] is not in ascending slot order")


def plan(load: torch.Tensor, num_ranks: int, *, num_redundant: int = 0, num_nodes: int = 1,
         hierarchical: bool = False, num_groups: int | None = None) -> ExpertPlacement:
    """A placement of ``num_logical + num_redundant`` slots that evens out the per-rank load.

    ``load`` is ``[layers, num_logical]`` token counts (``ExpertLoadWindow.totals()``);
    each layer is planned on its own. Per pool of ranks (all ranks, or one node):

    1. Copies: every expert gets one; each spare slot goes to the expert with the most
       load per copy, at most one copy per rank of the pool.
    2. Packing: copies (each carrying ``load / copies``), heaviest first, go to the least
       loaded rank that has a free slot and no copy of that expert yet; then pairs are
       swapped between the heaviest rank and the others while that lowers its load.

    ``hierarchical=True`` first cuts the experts into ``num_groups`` contiguous groups
    (default: one per expert) and packs whole groups onto the ``num_nodes`` nodes, equal
    group counts per node, balancing node load; then it runs 1-2 inside each node on
    that node's experts and ``num_physical / num_nodes`` slots. Every copy of an expert
    (and every expert of a group) then stays on one node: with group-limited routing
    (DeepSeek-V3), a token's dispatch reaches no more nodes than it picks groups.

    Deterministic: equal inputs give equal placements (ties go to the lower index).
    Raises ValueError naming the argument and its bound.
    """
    load = check_load(load)
    layers, num_logical = load.shape
    num_groups = _check_plan_args(num_logical, num_ranks, num_redundant, num_nodes,
                                  hierarchical, num_groups)
    num_physical = num_logical + num_redundant
    slots_per_rank = num_physical // num_ranks
    p2l = torch.empty(layers, num_physical, dtype=torch.int64)
    for layer in range(layers):
        weights = load[layer].tolist()
        if hierarchical:
            size = num_logical // num_groups
            group_load = [sum(weights[g * size:(g + 1) * size]) for g in range(num_groups)]
            nodes = _pack(group_load, list(range(num_groups)), num_nodes, num_groups // num_nodes)
            pools = [[e for g in sorted(node) for e in range(g * size, (g + 1) * size)]
                     for node in nodes]
        else:
            pools = [list(range(num_logical))]
        ranks_per_pool = num_ranks // len(pools)
        slots = []
        for experts in pools:
            slots += _plan_pool([weights[e] for e in experts], experts, ranks_per_pool,
                                slots_per_rank)
        p2l[layer] = torch.tensor(slots)
    return ExpertPlacement.from_physical_to_logical(p2l, num_logical, num_ranks)


def moves(old: ExpertPlacement, new: ExpertPlacement) -> int:
    """Expert weights that must travel to go from ``old`` to ``new``: summed over layers and
    ranks, the logical experts a rank holds in ``new`` and did not hold in ``old``.
    (Reordering slots within a rank is a local copy and does not count.)"""
    if (old.num_layers, old.num_logical, old.num_ranks) != (
            new.num_layers, new.num_logical, new.num_ranks):
        raise ValueError(
            f"placements differ in [layers, num_logical, num_ranks]: "
            f"{[old.num_layers, old.num_logical, old.num_ranks]} vs "
            f"{[new.num_layers, new.num_logical, new.num_ranks]}")
    return int((_held(new) & ~_held(old)).sum())


def keep_in_place(old: ExpertPlacement, new: ExpertPlacement, num_nodes: int = 1) -> ExpertPlacement:
    """``new`` with its ranks renumbered (within each of ``num_nodes`` nodes) and the slots of
    each rank reordered so that slots keep the expert they hold in ``old`` where they can.

    Every rank keeps the set of copies ``new`` gave it, so the per-rank loads, and with
    them balancedness, are those of ``new``; only fewer weights move. Per layer, new
    ranks are matched greedily to the old rank they share most experts with (ties to
    the lower index), then each rank's experts go back into the slots that held them.
    """
    if (old.num_layers, old.num_logical, old.num_physical, old.num_ranks) != (
            new.num_layers, new.num_logical, new.num_physical, new.num_ranks):
        raise ValueError("keep_in_place: placements differ in [layers, num_logical, "
                         "num_physical, num_ranks]")
    if num_nodes < 1 or new.num_ranks % num_nodes:
        raise ValueError(f"num_ranks ({new.num_ranks}) must be divisible by num_nodes ({num_nodes})")
    ranks, size = new.num_ranks, new.slots_per_rank
    per_node = ranks // num_nodes
    p2l = torch.empty_like(new.physical_to_logical)
    for layer in range(new.num_layers):
        was = old.physical_to_logical[layer].view(ranks, size).tolist()
        now = new.physical_to_logical[layer].view(ranks, size).tolist()
        holders: dict[int, list[int]] = {}
        for q, experts in enumerate(was):
            for e in set(experts):
                holders.setdefault(e, []).append(q)
        shared: dict[tuple[int, int], int] = {}
        for r, experts in enumerate(now):
            for e in set(experts):
                for q in holders.get(e, ()):
                    if q // per_node == r // per_node:
                        shared[r, q] = shared.get((r, q), 0) + 1
        match: dict[int, int] = {}
        taken: set[int] = set()
        for (r, q), _ in sorted(shared.items(), key=lambda kv: (-kv[1], kv[0])):
            if r not in match and q not in taken:
                match[r] = q
                taken.add(q)
        for r in range(ranks):
            if r not in match:
                node = r // per_node
                q = next(q for q in range(node * per_node, (node + 1) * per_node) if q not in taken)
                match[r] = q
                taken.add(q)
        row = p2l[layer].view(ranks, size)
        for r, q in match.items():
            left = list(now[r])
            slots: list[int | None] = [None] * size
            for i, e in enumerate(was[q]):
                if e in left:
                    slots[i] = e
                    left.remove(e)
            left.sort()
            row[q] = torch.tensor([e if e is not None else left.pop(0) for e in slots])
    return ExpertPlacement.from_physical_to_logical(p2l, new.num_logical, new.num_ranks)


def _held(placement: ExpertPlacement) -> torch.Tensor:
    """``[layers, num_ranks, num_logical]``: whether the rank holds a copy of the expert."""
    p2l = placement.physical_to_logical.cpu().view(placement.num_layers, placement.num_ranks, -1)
    held = torch.zeros(placement.num_layers, placement.num_ranks, placement.num_logical,
                       dtype=torch.bool)
    return held.scatter_(2, p2l, True)


def _plan_pool(weights: list[float], experts: list[int], num_ranks: int,
               slots_per_rank: int) -> list[int]:
    """Steps 1-2 of :func:`plan` for one pool: the expert in each of its slots, rank-major
    (within a rank, experts ascending)."""
    copies = _replicate(weights, num_ranks * slots_per_rank, cap=num_ranks)
    item_weight, item_expert = [], []
    for i, n in enumerate(copies):
        item_weight += [weights[i] / n] * n
        item_expert += [experts[i]] * n
    ranks = _pack(item_weight, item_expert, num_ranks, slots_per_rank)
    return [e for rank in ranks for e in sorted(item_expert[i] for i in rank)]


def _replicate(weights: list[float], num_slots: int, cap: int) -> list[int]:
    """Copies per expert: one each, then each spare slot to the largest ``weight / copies``
    among experts below ``cap`` copies. (The caller's bound keeps ``num_slots`` reachable.)"""
    copies = [1] * len(weights)
    heap = [(-w, i) for i, w in enumerate(weights)] if cap > 1 else []
    heapq.heapify(heap)
    for _ in range(num_slots - len(weights)):
        _, i = heapq.heappop(heap)
        copies[i] += 1
        if copies[i] < cap:
            heapq.heappush(heap, (-weights[i] / copies[i], i))
    return copies


def _pack(weights: list[float], keys: list[int], num_bins: int, capacity: int) -> list[list[int]]:
    """Split items into ``num_bins`` bins of exactly ``capacity`` items each, no two items of
    one key in a bin, evening out the bin sums. Returns the item indices per bin.

    Needs ``len(weights) == num_bins * capacity`` and at most ``num_bins`` items per key.
    """
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    totals = [0.0] * num_bins
    held: list[set[int]] = [set() for _ in range(num_bins)]
    for i in sorted(range(len(weights)), key=lambda i: -weights[i]):
        open_bins = [b for b in range(num_bins)
                     if len(bins[b]) < capacity and keys[i] not in held[b]]
        if open_bins:
            b = min(open_bins, key=lambda b: (totals[b], len(bins[b]), b))
        else:
            b = _make_room(i, weights, keys, bins, totals, held, capacity)
        bins[b].append(i)
        totals[b] += weights[i]
        held[b].add(keys[i])
    return _swap_down(weights, keys, bins)


def _make_room(i, weights, keys, bins, totals, held, capacity) -> int:
    """Every bin with a free slot already holds ``keys[i]``: move an item ``j`` from a full
    bin ``q`` lacking that key into such a bin ``r``, and return ``q`` for item ``i``.

    Such a ``j`` exists: ``q`` has ``capacity`` distinct keys, ``r`` fewer than ``capacity``
    including ``keys[i]``, so some key of ``q`` is missing from ``r``. Of all the legal
    moves, the one with the lowest resulting max of the two bins is taken.
    """
    best = None
    for r in (b for b in range(len(bins)) if len(bins[b]) < capacity):
        for q in (b for b in range(len(bins)) if keys[i] not in held[b]):
            for j in (j for j in bins[q] if keys[j] not in held[r]):
                cost = max(totals[r] + weights[j], totals[q] - weights[j] + weights[i])
                if best is None or cost < best[0]:
                    best = (cost, r, q, j)
    _, r, q, j = best
    bins[q].remove(j)
    bins[r].append(j)
    totals[q] -= weights[j]
    totals[r] += weights[j]
    held[q].discard(keys[j])
    held[r].add(keys[j])
    return q


def _swap_down(weights: list[float], keys: list[int], bins: list[list[int]]) -> list[list[int]]:
    """Local search after the greedy fill: swap one item of the heaviest bin with a lighter
    item elsewhere when both bins end below the heaviest's old sum, best swap first.

    Each swap lowers the sum of squared bin totals, so this ends; the round cap bounds time.
    """
    num_bins, capacity = len(bins), len(bins[0])
    if num_bins < 2 or capacity == 0:
        return bins
    item = torch.tensor(bins)  # [bins, capacity] item indices
    w = torch.tensor(weights, dtype=torch.float64)
    key = torch.tensor(keys)
    held = torch.zeros(num_bins, int(key.max()) + 1, dtype=torch.bool)
    held[torch.arange(num_bins)[:, None], key[item]] = True
    bin_of = torch.arange(num_bins)[:, None].expand_as(item).reshape(-1)
    for _ in range(4 * len(weights)):
        totals = w[item].sum(1)
        h = int(totals.argmax())
        mine = item[h]  # [capacity]
        flat = item.reshape(-1)
        delta = w[mine][:, None] - w[flat][None, :]
        after = torch.maximum(totals[h] - delta, totals[bin_of][None, :] + delta)
        legal = ((bin_of != h)[None, :] & (delta > 0)
                 & (after < totals[h] - 1e-9 * max(float(totals[h]), 1.0))
                 & ~held[bin_of[None, :], key[mine][:, None]] & ~held[h, key[flat]][None, :])
        if not bool(legal.any()):
            break
        a, b = divmod(int(torch.where(legal, after, torch.inf).argmin()), len(flat))
        r, slot = divmod(b, capacity)
        ka, kb = int(key[mine[a]]), int(key[flat[b]])
        held[h, ka] = held[r, kb] = False
        held[h, kb] = held[r, ka] = True
        item[h, a], item[r, slot] = int(flat[b]), int(mine[a])
    return item.tolist()


def check_load(load: torch.Tensor) -> torch.Tensor:
    """``load`` as float64 on the CPU; ValueError unless it is ``[layers, num_logical]``,
    finite and >= 0."""
    load = torch.as_tensor(load).detach().to("cpu", torch.float64)
    if load.dim() != 2 or load.shape[1] < 1:
        raise ValueError(f"load must be 2-D [layers, num_logical] with num_logical >= 1, "
                         f"got shape {tuple(load.shape)}")
    if not bool(torch.isfinite(load).all()) or bool((load < 0).any()):
        raise ValueError("load must be finite and >= 0")
    return load


def _check_plan_args(num_logical: int, num_ranks: int, num_redundant: int, num_nodes: int,
                     hierarchical: bool, num_groups: int | None) -> int:
    """Validate :func:`plan`'s arguments; return the number of groups to use."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if num_redundant < 0:
        raise ValueError(f"num_redundant must be >= 0, got {num_redundant}")
    if num_nodes < 1 or num_ranks % num_nodes:
        raise ValueError(f"num_ranks ({num_ranks}) must be divisible by num_nodes ({num_nodes})")
    num_physical = num_logical + num_redundant
    if num_physical % num_ranks:
        raise ValueError(f"num_physical = num_logical ({num_logical}) + num_redundant "
                         f"({num_redundant}) = {num_physical} must be divisible by num_ranks "
                         f"({num_ranks})")
    # A second copy of an expert on the same rank adds no capacity, so each pool of ranks
    # holds at most one copy per rank of each of its experts.
    pool = num_ranks // num_nodes if hierarchical else num_ranks
    bound = num_logical * (pool - 1)
    if num_redundant > bound:
        where = "num_ranks / num_nodes" if hierarchical else "num_ranks"
        raise ValueError(f"num_redundant ({num_redundant}) must be <= num_logical * ({where} - 1)"
                         f" = {bound}: a rank holds at most one copy of an expert")
    if not hierarchical:
        if num_groups is not None:
            raise ValueError("num_groups is only used with hierarchical=True")
        return 1
    num_groups = num_logical if num_groups is None else num_groups
    if num_groups < 1 or num_logical % num_groups:
        raise ValueError(f"num_logical ({num_logical}) must be divisible by num_groups "
                         f"({num_groups})")
    if num_groups % num_nodes:
        raise ValueError(f"num_groups ({num_groups}) must be divisible by num_nodes ({num_nodes})")
    return num_groups


def _check_expert_ids(p2l: torch.Tensor, num_logical: int) -> None:
    _first_bad((p2l < 0) | (p2l >= num_logical),
               f"physical_to_logical[{{}}, {{}}] is outside [0, num_logical={num_logical})")


def _first_bad(mask: torch.Tensor, message: str) -> None:
    """Raise ValueError with ``message`` formatted with the index of the first True in ``mask``."""
    bad = mask.nonzero()
    if len(bad):
        raise ValueError(message.format(*bad[0].tolist()))
