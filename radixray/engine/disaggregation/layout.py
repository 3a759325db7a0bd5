"""KV copy spans: which byte ranges of one pool go where in another.

Slots are per token (a request's slots need not be contiguous). Runs of slots that are
contiguous on both sides become one span per layer and per key/value buffer, so a
prompt placed in fresh pools moves as 2 x layers writes whatever its length.

With tensor parallelism each rank's pool holds some of the KV heads, side by side in a
slot's row. Two workers of different ``tp_size`` re-slice: each destination rank's heads
come from a source rank that holds them (:func:`head_plan`), and a piece of a row is
written per slot (:func:`copy_spans` with a :class:`HeadPiece`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixray.engine.disaggregation.messages import KVEndpoint, KVLayout


@dataclass(frozen=True, slots=True)
class HeadPiece:
    """``count`` KV heads from local head ``src_head`` of a source row into local head
    ``dst_head`` of a destination row."""

    src_head: int
    dst_head: int
    count: int


def pool_layout(k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor],
                heads: tuple[int, ...] | None = None) -> KVLayout:
    """The layout of a pool's per-layer ``[slots, kv_heads, head_dim]`` buffers holding the
    model's KV heads ``heads`` (default: all of them, in order)."""
    first = k_buffers[0]
    heads = tuple(range(first.shape[1])) if heads is None else tuple(heads)
    if len(heads) != first.shape[1]:
        raise ValueError(f"{len(heads)} KV head ids for buffers of {first.shape[1]} heads")
    slot_bytes = first[0].numel() * first.element_size()
    for buf in k_buffers + v_buffers:
        if not buf.is_contiguous():
            raise ValueError("KV buffers must be contiguous to be transferred")
    return KVLayout(tuple(b.data_ptr() for b in k_buffers), tuple(b.data_ptr() for b in v_buffers),
                    slot_bytes, str(first.dtype).removeprefix("torch."), heads)


def head_plan(src: KVEndpoint, src_rank: int, dst: KVEndpoint) -> dict[int, list[HeadPiece]]:
    """What source rank ``src_rank`` writes: destination rank -> the pieces of its rows.

    Every KV head a destination rank holds comes from exactly one source rank holding it;
    when several do (a head replicated over ranks), destination rank ``d`` takes it from
    the ``d``-th of them, round robin, so the writes spread over the source ranks."""
    plan: dict[int, list[HeadPiece]] = {}
    for d, layout in enumerate(dst.layouts):
        for j, head in enumerate(layout.heads):
            holders = [r for r, lay in enumerate(src.layouts) if head in lay.heads]
            if not holders:
                raise ValueError(f"no source rank holds KV head {head}")
            if holders[d % len(holders)] != src_rank:
                continue
            i = src.layouts[src_rank].heads.index(head)
            pieces = plan.setdefault(d, [])
            last = pieces[-1] if pieces else None
            if last is not None and (last.src_head + last.count, last.dst_head + last.count) \
                    == (i, j):
                pieces[-1] = HeadPiece(last.src_head, last.dst_head, last.count + 1)
            else:
                pieces.append(HeadPiece(i, j, 1))
    return plan


def slot_runs(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group ``src[i] -> dst[i]`` into runs contiguous on both sides: (src starts, dst starts,
    lengths), int64 tensors of one entry per run."""
    src, dst = src.to(torch.int64), dst.to(torch.int64)
    if src.numel() != dst.numel():
        raise ValueError(f"{src.numel()} source slots for {dst.numel()} destination slots")
    if src.numel() == 0:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty, empty
    breaks = ((src[1:] - src[:-1]) != 1) | ((dst[1:] - dst[:-1]) != 1)
    starts = torch.cat((torch.zeros(1, dtype=torch.int64), torch.nonzero(breaks).flatten() + 1))
    ends = torch.cat((starts[1:], torch.tensor([src.numel()])))
    return src[starts], dst[starts], ends - starts


def copy_spans(src: KVLayout, src_slots: torch.Tensor, dst: KVLayout, dst_slots: torch.Tensor,
               piece: HeadPiece | None = None) -> tuple[list[int], list[int], list[int]]:
    """(source addresses, destination addresses, lengths) writing the KV of ``src_slots`` of
    pool ``src`` into ``dst_slots`` of pool ``dst``, every layer's key and value: whole
    rows (``piece`` None, both rows alike), or ``piece``'s heads of each row."""
    if piece is not None and (piece.count, piece.count) != (len(src.heads), len(dst.heads)):
        return _piece_spans(src, src_slots, dst, dst_slots, piece)
    s0, d0, n = slot_runs(src_slots, dst_slots)
    b = src.slot_bytes
    src_base = torch.tensor(src.k_addrs + src.v_addrs, dtype=torch.int64)
    dst_base = torch.tensor(dst.k_addrs + dst.v_addrs, dtype=torch.int64)
    src_addrs = (src_base[:, None] + s0[None, :] * b).flatten()
    dst_addrs = (dst_base[:, None] + d0[None, :] * b).flatten()
    lengths = (n * b).repeat(src_base.numel())
    return src_addrs.tolist(), dst_addrs.tolist(), lengths.tolist()


def _piece_spans(src: KVLayout, src_slots: torch.Tensor, dst: KVLayout, dst_slots: torch.Tensor,
                 piece: HeadPiece) -> tuple[list[int], list[int], list[int]]:
    """Part of each row: one span per slot, layer and key/value buffer."""
    src_slots, dst_slots = src_slots.to(torch.int64), dst_slots.to(torch.int64)
    if src_slots.numel() != dst_slots.numel():
        raise ValueError(f"{src_slots.numel()} source slots for {dst_slots.numel()} "
                         f"destination slots")
    hb = src.head_bytes
    src_base = torch.tensor(src.k_addrs + src.v_addrs, dtype=torch.int64) + piece.src_head * hb
    dst_base = torch.tensor(dst.k_addrs + dst.v_addrs, dtype=torch.int64) + piece.dst_head * hb
    src_addrs = (src_base[:, None] + src_slots[None, :] * src.slot_bytes).flatten()
    dst_addrs = (dst_base[:, None] + dst_slots[None, :] * dst.slot_bytes).flatten()
    return src_addrs.tolist(), dst_addrs.tolist(), [piece.count * hb] * src_addrs.numel()


def rank_spans(src: KVEndpoint, src_rank: int, src_slots: torch.Tensor, dst: KVEndpoint,
               dst_slots: torch.Tensor) -> list[tuple[str, list[int], list[int], list[int]]]:
    """Every write source rank ``src_rank`` makes for these slots: (destination session,
    source addresses, destination addresses, lengths), one entry per destination rank and
    piece."""
    mine = src.layouts[src_rank]
    writes = []
    for d, pieces in head_plan(src, src_rank, dst).items():
        for piece in pieces:
            writes.append((dst.sessions[d], *copy_spans(mine, src_slots, dst.layouts[d],
                                                        dst_slots, piece)))
    return writes
