"""Batched LoRA matmul: each row of a packed batch adds its own adapter's low-rank update.

A batch mixes requests of several adapters and of none. Row ``t`` uses the adapter in slot
``row_slots[t]`` (-1: no adapter) of stacked weights ``A`` ``[slots, r, in]`` and ``B``
``[slots, out, r]``, scaled by ``scalings[slot]``::

    y[t] = base[t] + scalings[s] * (x[t] @ A[s].T) @ B[s].T     (s = row_slots[t] >= 0)

:func:`lora_add_reference` computes it row by row (the reference); :func:`lora_add` groups
the rows by slot once per batch (:class:`LoraRows`) and runs two GEMMs per distinct adapter,
so its cost grows with the number of adapters in the batch, not the number of rows.

:func:`lora_add_stacked` is the decode form: no Python per adapter and no data-dependent
shapes, so torch.compile traces it (engine/executor/compiled_decode.py). It runs every row
through every slot in use, the first ``n`` (one GEMM for the shrink, one batched GEMM for
the expand), and a per-batch matrix :func:`row_slot_scales` ``[T, n]`` (row ``t``'s scaling
in its own slot's column, 0 elsewhere) keeps only each row's own adapter. Its cost is the
rows times every slot below the highest in use, so it suits decode batches (few rows);
extend batches keep the grouped :func:`lora_add`.
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


def row_slot_scales(row_slots: torch.Tensor, scalings: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """``[T, n]`` in ``dtype``: ``scalings[row_slots[t]]`` at ``(t, row_slots[t])``, 0 elsewhere
    (a row of zeros where ``row_slots[t]`` is -1); ``n`` is the highest slot of ``row_slots``
    plus one (at least 1). Built once per batch, eagerly; :func:`lora_add_stacked` reads it."""
    n = max(int(row_slots.max()) + 1, 1) if row_slots.numel() else 1
    scales = torch.zeros(row_slots.numel(), n, dtype=dtype, device=row_slots.device)
    rows = (row_slots >= 0).nonzero().flatten()
    slots = row_slots[rows]
    scales[rows, slots] = scalings.to(row_slots.device)[slots].to(dtype)
    return scales


def lora_add_stacked(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     scales: torch.Tensor) -> torch.Tensor:
    """:func:`lora_add` for few rows, traceable: ``base`` ``[T, out]`` plus ``sum_s scales[t, s] *
    (x[t] @ a[s].T) @ b[s].T`` over the first ``n = scales.shape[1]`` slots of ``a`` ``[slots, r,
    in]`` (contiguous) and ``b`` ``[slots, out, r]``; ``scales`` from :func:`row_slot_scales`.
    Adds into ``base`` in place and returns it. The weights are read through views, never
    copied."""
    rows, n = scales.shape
    if rows == 1:  # inductor lowers a one-row CPU bmm to mul+sum (another summation order
        x, scales = x.expand(2, -1), scales.expand(2, -1)  # than eager's); two keep aten's
    a, b = a[:n], b[:n]
    r = a.shape[1]
    shrink = x @ a.reshape(n * r, a.shape[2]).T  # [T, n*r]: every slot's shrink in one GEMM
    shrink = shrink.view(-1, n, r) * scales.unsqueeze(-1)
    delta = torch.bmm(shrink.transpose(0, 1), b.transpose(1, 2))  # [n, T, out]
    return base.add_(delta.sum(0)[:rows].to(base.dtype))


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
