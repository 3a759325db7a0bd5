"""KV copy spans: which byte ranges of one pool go where in another.

Slots are per token (a request's slots need not be contiguous). Runs of slots that are
contiguous on both sides become one span per layer and per key/value buffer, so a
prompt placed in fresh pools moves as 2 x layers writes whatever its length.
"""

from __future__ import annotations

import torch

from radixray.engine.disaggregation.messages import KVLayout


def pool_layout(k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor]) -> KVLayout:
    """The layout of a pool's per-layer ``[slots, kv_heads, head_dim]`` buffers."""
    first = k_buffers[0]
    slot_bytes = first[0].numel() * first.element_size()
    for buf in k_buffers + v_buffers:
        if not buf.is_contiguous():
            raise ValueError("KV buffers must be contiguous to be transferred")
    return KVLayout(tuple(b.data_ptr() for b in k_buffers), tuple(b.data_ptr() for b in v_buffers),
                    slot_bytes, str(first.dtype).removeprefix("torch."))


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


def copy_spans(src: KVLayout, src_slots: torch.Tensor, dst: KVLayout,
               dst_slots: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """(source addresses, destination addresses, lengths) writing the KV of ``src_slots`` of
    pool ``src`` into ``dst_slots`` of pool ``dst``, every layer's key and value."""
    s0, d0, n = slot_runs(src_slots, dst_slots)
    b = src.slot_bytes
    src_base = torch.tensor(src.k_addrs + src.v_addrs, dtype=torch.int64)
    dst_base = torch.tensor(dst.k_addrs + dst.v_addrs, dtype=torch.int64)
    src_addrs = (src_base[:, None] + s0[None, :] * b).flatten()
    dst_addrs = (dst_base[:, None] + d0[None, :] * b).flatten()
    lengths = (n * b).repeat(src_base.numel())
    return src_addrs.tolist(), dst_addrs.tolist(), lengths.tolist()
