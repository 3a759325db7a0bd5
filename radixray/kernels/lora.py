"""Batched LoRA matmul: each row of a packed batch adds its own adapter's low-rank update.

A batch mixes requests of several adapters and of none. Row ``t`` uses the adapter in slot
``row_slots[t]`` (-1: no adapter) of stacked weights ``A`` ``[slots, r, in]`` and ``B``
``[slots, out, r]``, scaled by ``scalings[slot]``::

    y[t] = base[t] + scalings[s] * (x[t] @ A[s].T) @ B[s].T     (s = row_slots[t] >= 0)

:func:`lora_add_reference` computes it row by row (the reference); :func:`lora_add` groups
the rows by slot once per batch (:class:`LoraRows`) and runs two GEMMs per distinct adapter,
so its cost grows with the number of adapters in the batch, not the number of rows.

:func:`lora_add_segments` is the decode form: one opaque op (``radixray_lora::add_segments``,
with a shape-only fake) that torch.compile keeps as a single call in a compiled decode
step (engine/executor/compiled_decode.py), eager or compiled the same computation. The
rows with an adapter are sorted by slot once per batch (:class:`LoraSegments`); the op
gathers them, runs one grouped GEMM for the shrink and one for the expand
(``torch._grouped_mm``: each row against its own adapter only, each slot in use read
once), and adds the update back. (A dense form that runs every row through every slot in
use traces without an op of its own, but multiplies the work by the count of slots in use:
it lost to this one with 4 adapters, docs/benchmarks.md.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoraRows:
    """The rows of a packed batch grouped by adapter slot: ``groups[i] = (slot, rows)``, the
    rows an int64 index tensor, or None when that slot covers every row of the batch (no
    gather or scatter needed). Built once per forward pass; every LoRA layer reuses it."""

    groups: list[tuple[int, torch.Tensor | None]]
    num_rows: int

    @classmethod
    def of(cls, row_slots: torch.Tensor) -> LoraRows:
        """Group ``row_slots`` ``[T]`` (-1: no adapter)."""
        n = int(row_slots.numel())
        slots = [int(s) for s in torch.unique(row_slots).tolist() if s >= 0]
        if len(slots) == 1 and bool((row_slots == slots[0]).all()):
            return cls([(slots[0], None)], n)
        return cls([(s, (row_slots == s).nonzero().flatten()) for s in slots], n)


def lora_add(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             scalings: torch.Tensor, rows: LoraRows) -> torch.Tensor:
    """``base`` ``[T, out]`` plus each row's adapter update of ``x`` ``[T, in]`` (see the module
    docstring); ``a`` ``[slots, r, in]``, ``b`` ``[slots, out, r]``, ``scalings`` ``[slots]``
    (a CPU float tensor). Adds into ``base`` in place and returns it."""
    for slot, idx in rows.groups:
        scale = float(scalings[slot])
        if idx is None:
            base.add_((x @ a[slot].T) @ b[slot].T, alpha=scale)
        else:
            delta = (x.index_select(0, idx) @ a[slot].T) @ b[slot].T
            base.index_add_(0, idx, delta.to(base.dtype), alpha=scale)
    return base


@dataclass
class LoraSegments:
    """A decode batch's rows that use an adapter, sorted by slot (stable), built once per
    batch: ``rows`` ``[N]`` int64 row indices; ``ends`` ``[n]`` int32, where slot ``g``'s rows
    are ``rows[ends[g-1]:ends[g]]`` for every slot up to the highest in use (empty for a
    slot no row uses); ``scales`` ``[N]`` each row's slot scaling, in the weights' dtype."""

    rows: torch.Tensor
    ends: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def of(cls, row_slots: torch.Tensor, scalings: torch.Tensor,
           dtype: torch.dtype) -> LoraSegments:
        """The segments of ``row_slots`` ``[T]`` (-1: no adapter) with ``scalings`` ``[slots]``."""
        order = torch.argsort(row_slots, stable=True)
        rows = order[row_slots[order] >= 0]
        slots = row_slots[rows]
        n = int(slots.max()) + 1 if rows.numel() else 0
        ends = torch.bincount(slots, minlength=n).cumsum(0).to(torch.int32)
        return cls(rows, ends, scalings.to(row_slots.device)[slots].to(dtype))


def lora_add_segments(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      segments: LoraSegments) -> torch.Tensor:
    """``base`` ``[T, out]`` plus each row's adapter update of ``x`` ``[T, in]`` (the module
    docstring), ``a`` ``[slots, r, in]``, ``b`` ``[slots, out, r]``; a new tensor."""
    return torch.ops.radixray_lora.add_segments(base, x, a, b, segments.rows, segments.ends,
                                                segments.scales)


@torch.library.custom_op("radixray_lora::add_segments", mutates_args=())
def _add_segments(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  rows: torch.Tensor, ends: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n = ends.numel()
    if not rows.numel():
        return base.clone()
    shrink = _grouped_mm(x.index_select(0, rows), a[:n].transpose(1, 2), ends)
    shrink.mul_(scales.unsqueeze(1))
    delta = _grouped_mm(shrink, b[:n].transpose(1, 2), ends)
    return base.index_add(0, rows, delta.to(base.dtype))


@_add_segments.register_fake
def _(base, x, a, b, rows, ends, scales):
    return torch.empty_like(base)


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``x[rows of group g] @ w[g]`` for the groups ``ends`` cuts ``x`` ``[N, k]`` into; ``w``
    ``[n, k, m]``. torch's grouped GEMM where its operands are 16-byte aligned (it refuses
    others), else one GEMM per group."""
    if all(_aligned(t) for t in (x, w)):
        return torch._grouped_mm(x, w, offs=ends)
    out = x.new_empty(x.shape[0], w.shape[2])
    start = 0
    for g, end in enumerate(ends.tolist()):
        torch.mm(x[start:end], w[g], out=out[start:end])
        start = end
    return out


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(
        stride * size % 16 == 0 for stride, dim in zip(t.stride(), t.shape)
        if stride != 1 and dim > 1)


def lora_add_reference(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       scalings: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
    """The reference: one row at a time, in float64; returns a new tensor of ``base``'s dtype."""
    out = base.double().clone()
    for t, slot in enumerate(row_slots.tolist()):
        if slot < 0:
            continue
        shrink = x[t].double() @ a[slot].double().T
        out[t] += float(scalings[slot]) * (shrink @ b[slot].double().T)
    return out.to(base.dtype)
