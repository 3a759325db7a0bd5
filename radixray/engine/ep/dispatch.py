"""Expert parallelism: each rank of a process group holds a share of the expert slots.

With ``world_size`` ranks and ``num_physical`` slots, rank ``r`` holds the
``S = num_physical // world_size`` slots ``[r * S, (r + 1) * S)`` (the layout of
``eplb_planner.ExpertPlacement``: slot ``s`` lives on rank ``s // S``). Attention is
data-parallel, so every rank brings its own tokens to each MoE layer and the
dispatcher sends them to the ranks holding their experts and the results back.

- :class:`ExpertShard`: a rank's local slots and their computation, shared by the
  backends.
- :class:`CollectivesExperts` (``collectives``): ``torch.distributed`` all-to-alls
  (gloo on the CPU, NCCL on GPUs), bit-equal to :class:`~.experts.LocalExperts` where
  the kernels are batch-invariant.
- ``ep_deepep.DeepEPExperts`` (``deepep``): DeepEP's NVLink/RDMA kernels, GPU only.
- :func:`~.factory.make_expert_dispatcher` picks one by the ``ep_dispatch_backend`` name.

Every rank of the group must call ``dispatch`` once per MoE layer per forward pass,
with zero tokens if it has none, or its peers wait for it in the collective.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist

from radixray.engine.models.experts import LocalExperts
from radixray.kernels.cpu_ops import CpuKernels

SLOT_ID_BYTES = 4  # local slot ids travel as int32
COUNT_BYTES = 8  # per-rank pair counts travel as int64


def a2a_bytes_per_token(hidden_size: int, top_k: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(dispatch, combine)`` bytes that :class:`CollectivesExperts` moves between ranks
    for one token in one MoE layer when all ``top_k`` of its experts live on other ranks.

    Dispatch sends one hidden row and one int32 local slot id per (token, expert) pair,
    ``k * (H * b + 4)``; combine sends one result row back per pair, ``k * H * b`` (``b``
    the dtype's bytes). Rows are not deduplicated when a token picks several experts on
    one rank: that would save ``H * b`` per repeat on dispatch but not on combine, whose
    rows stay per pair to keep the sum's order, and it needs a second index exchange.
    Pairs routed to the token's own rank cost nothing (uniform routing over ``W`` ranks
    sends ``(W - 1) / W`` of them away), and each rank adds ``(W - 1) * 8`` bytes of counts
    per layer. DeepEP sends a token once per destination rank and sums there, so it
    moves about ``m * H * b`` each way (plus the top-k ids and weights on dispatch),
    ``m`` the number of distinct remote ranks among the token's k experts.
    """
    row = hidden_size * dtype.itemsize
    return top_k * (row + SLOT_ID_BYTES), top_k * row


@dataclass
class CommCounters:
    """What a dispatcher's exchanges cost, summed over ``calls`` dispatches; a benchmark
    reads them to report dispatch/combine's share of the step and replaces the object
    (``dispatcher.counters = CommCounters()``) to start over."""

    calls: int = 0
    seconds: float = 0.0  # wall time inside collectives (on CUDA, synchronised around each)
    dispatch_bytes: int = 0  # sent to other ranks: counts, hidden rows and slot ids
    combine_bytes: int = 0  # sent to other ranks: result rows of their tokens

    @property
    def bytes_sent(self) -> int:
        return self.dispatch_bytes + self.combine_bytes


class ExpertShard(LocalExperts):
    """The ``S = num_physical // world_size`` slots of rank ``rank`` and their computation.

    Parameters as in :class:`~.experts.LocalExperts` but ``[S, ...]``: local slot ``i`` is
    physical slot ``local_slots[i]``, so a loader copies ``full[local_slots]``. It is a
    ``LocalExperts`` over the local slots, so the per-slot grouping and matmuls are that
    class's code; ``num_physical`` is the whole layer's slot count, as the
    :class:`~.experts.ExpertDispatcher` contract wants.
    """

    def __init__(self, num_physical: int, rank: int, world_size: int, hidden_size: int,
                 intermediate_size: int, kernels: CpuKernels):
        if world_size < 1 or num_physical % world_size:
            raise ValueError(f"the number of expert slots ({num_physical}) must be divisible "
                             f"by ep_size ({world_size})")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        super().__init__(num_physical // world_size, hidden_size, intermediate_size, kernels)
        self.num_physical = num_physical
        self.rank = rank
        self.world_size = world_size
        self.slots_per_rank = num_physical // world_size
        self.local_slots = range(rank * self.slots_per_rank, (rank + 1) * self.slots_per_rank)

    def expert_outputs(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """``expert[local_ids[i]](rows[i])`` for each row, unweighted, in ``rows``' dtype:
        LocalExperts' computation with k = 1 and weight 1, which is exact."""
        ones = rows.new_ones(rows.shape[0], 1)
        return LocalExperts.dispatch(self, rows, local_ids.long()[:, None], ones)

    @abstractmethod
    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        """A backend exchanges the tokens; the shard alone holds only part of the experts."""


class CollectivesExperts(ExpertShard):
    """Expert parallelism over ``torch.distributed`` all-to-alls (``group``, default WORLD).

    One :meth:`dispatch` makes four ``all_to_all_single`` calls in this order:

    1. counts: how many (token, expert) pairs this rank sends to each rank (int64);
    2. the pairs' local slot ids (int32), sorted by physical slot, so by rank;
    3. the pairs' hidden rows, in the same order;
    4. back: each received row's unweighted expert output, to the rank it came from.

    The source then weights each product, rounds it to ``hidden``'s dtype and adds a
    token's k products in increasing slot order, which is what LocalExperts does, so
    the output is bit-equal to it wherever the kernels are batch-invariant (the
    receiving rank computes a slot on other ranks' rows too). Bytes:
    :func:`a2a_bytes_per_token`; cost so far: :attr:`counters`.
    """

    def __init__(self, num_physical: int, rank: int, world_size: int, hidden_size: int,
                 intermediate_size: int, kernels: CpuKernels,
                 group: dist.ProcessGroup | None = None):
        super().__init__(num_physical, rank, world_size, hidden_size, intermediate_size, kernels)
        self.group = group
        self.counters = CommCounters()
        if dist.is_initialized():
            actual = (dist.get_rank(group), dist.get_world_size(group))
            if actual != (rank, world_size):
                raise ValueError(f"rank {rank} of {world_size} does not match the process "
                                 f"group, which says rank {actual[0]} of {actual[1]}")

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        num_tokens, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by slot, hence grouped by rank
        slots = flat[order]
        dest = slots // self.slots_per_rank
        send_counts = torch.bincount(dest, minlength=self.world_size)
        if send_counts.numel() != self.world_size:
            raise ValueError(f"topk_ids holds slot {int(flat.max())}, past num_physical "
                             f"({self.num_physical})")
        recv_counts = torch.empty_like(send_counts)
        self._all_to_all(recv_counts, send_counts)
        send, recv = send_counts.tolist(), recv_counts.tolist()

        recv_ids = torch.empty(sum(recv), dtype=torch.int32, device=hidden.device)
        self._all_to_all(recv_ids, (slots - dest * self.slots_per_rank).to(torch.int32),
                         recv, send)
        recv_rows = hidden.new_empty(sum(recv), hidden.shape[1])
        self._all_to_all(recv_rows, hidden[order // k], recv, send)
        results = self.expert_outputs(recv_rows, recv_ids)
        back = hidden.new_empty(num_tokens * k, hidden.shape[1])
        self._all_to_all(back, results, send, recv)

        self._count(send, recv, hidden)
        return self._combine(back, order, topk_ids, topk_weights, hidden)

    def _combine(self, back: torch.Tensor, order: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Weighted sum of the k outputs of each token: products rounded to hidden's dtype,
        added in increasing slot order, one column at a time (deterministic on any device,
        where an ``index_add_`` with repeated rows is not on CUDA)."""
        num_tokens, k = topk_ids.shape
        products = (back * topk_weights.reshape(-1)[order, None]).to(hidden.dtype)
        per_pair = torch.empty_like(products)
        per_pair[order] = products  # back to (token, j) order
        by_slot = torch.argsort(topk_ids, dim=1, stable=True)
        per_pair = per_pair.view(num_tokens, k, hidden.shape[1])
        per_pair = per_pair.gather(1, by_slot[:, :, None].expand_as(per_pair))
        out = torch.zeros_like(hidden)
        for j in range(k):
            out += per_pair[:, j]
        return out

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor,
                    out_splits: list[int] | None = None,
                    in_splits: list[int] | None = None) -> None:
        if inp.is_cuda:  # time the transfer, not whatever the stream had queued before it
            torch.cuda.synchronize(inp.device)
        start = time.perf_counter()
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        if inp.is_cuda:
            torch.cuda.synchronize(inp.device)
        self.counters.seconds += time.perf_counter() - start

    def _count(self, send: list[int], recv: list[int], hidden: torch.Tensor) -> None:
        row = hidden.shape[1] * hidden.element_size()
        sent_away = sum(send) - send[self.rank]
        received_from_others = sum(recv) - recv[self.rank]
        self.counters.calls += 1
        self.counters.dispatch_bytes += ((self.world_size - 1) * COUNT_BYTES
                                         + sent_away * (row + SLOT_ID_BYTES))
        self.counters.combine_bytes += received_from_others * row
