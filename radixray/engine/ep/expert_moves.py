"""Moving expert weights into a new placement: copies within a rank, and between the ranks of
an expert-parallel group.

A rebalance (``engine/ep/eplb.py``) gives every slot whose expert changes a source slot that
holds that expert now (:meth:`~radixray.engine.ep.expert_map.ExpertMap.transfers`).
Each rank's experts are stacked along dim 0 of its dispatcher's parameters, local slot
``i`` being physical slot ``rank * slots_per_rank + i``. For every MoE layer that has a
copy between two ranks, each parameter moves in one ``all_to_all_single`` over the group:
a rank sends the slots it is the source of, ordered by destination, and receives the
slots it is the destination of, ordered by source rank then destination. Every rank
derives the same counts from the same transfer list, so no sizes are exchanged first,
and every rank makes the same collectives in the same order (those with nothing to send
join with empty buffers). A layer with only local copies makes no collective.

Every copy is read (and received) before any slot is written, so a failure part way
(memory, a lost peer) leaves each rank's old weights whole. The moved slots are held
once more while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MoveStats:
    """What this rank did in one move: slots copied within it, slots it received from and
    sent to other ranks, and the bytes of the latter two."""

    local_copies: int = 0
    received: int = 0
    sent: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0


def move_expert_weights(blocks, transfers: list[list[tuple[int, int]]], rank: int,
                        world_size: int, slots_per_rank: int, group=None) -> MoveStats:
    """Copy ``(destination, source)`` physical slots of ``transfers[i]`` in ``blocks[i]``'s
    dispatcher (each parameter stacked over this rank's slots along dim 0). Every rank of
    the group calls it with the same ``transfers``. Returns this rank's :class:`MoveStats`."""
    stats = MoveStats()
    writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for block, pairs in zip(blocks, transfers):
        if not pairs:
            continue
        local = [(d, s) for d, s in pairs if d // slots_per_rank == rank == s // slots_per_rank]
        sends = [(d, s) for d, s in pairs
                 if s // slots_per_rank == rank and d // slots_per_rank != rank]
        recvs = sorted(((d, s) for d, s in pairs
                        if d // slots_per_rank == rank and s // slots_per_rank != rank),
                       key=lambda ds: (ds[1] // slots_per_rank, ds[0]))
        crosses = any(d // slots_per_rank != s // slots_per_rank for d, s in pairs)
        base = rank * slots_per_rank
        for param in block.experts.parameters():
            data = param.data
            if local:
                dst = torch.tensor([d - base for d, _ in local], device=data.device)
                src = torch.tensor([s - base for _, s in local], device=data.device)
                writes.append((data, dst, data[src]))
            if crosses:
                received = _exchange(data, sends, recvs, base, world_size, slots_per_rank,
                                     group)
                if recvs:
                    dst = torch.tensor([d - base for d, _ in recvs], device=data.device)
                    writes.append((data, dst, received))
                slot_bytes = data[0].numel() * data.element_size()
                stats.bytes_sent += len(sends) * slot_bytes
                stats.bytes_received += len(recvs) * slot_bytes
        stats.local_copies += len(local)
        stats.sent += len(sends)
        stats.received += len(recvs)
    with torch.no_grad():
        for data, dst, values in writes:
            data[dst] = values
    return stats


def _exchange(data: torch.Tensor, sends, recvs, base: int, world_size: int,
              slots_per_rank: int, group) -> torch.Tensor:
    """One ``all_to_all_single`` of whole slots of ``data``: the rows this rank sends (in
    destination order) out, the rows it receives (in source-rank order) back."""
    import torch.distributed as dist
    send_counts = [0] * world_size
    for d, _ in sends:
        send_counts[d // slots_per_rank] += 1
    recv_counts = [0] * world_size
    for _, s in recvs:
        recv_counts[s // slots_per_rank] += 1
    idx = torch.tensor([s - base for _, s in sends], dtype=torch.int64, device=data.device)
    inp = data[idx].contiguous()
    out = data.new_empty((len(recvs), *data.shape[1:]))
    dist.all_to_all_single(out, inp, output_split_sizes=recv_counts,
                           input_split_sizes=send_counts, group=group)
    return out
