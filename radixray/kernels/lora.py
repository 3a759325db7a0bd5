"""Batched LoRA matmul: each row of a packed batch adds its own adapter's low-rank update.

A batch mixes requests of several adapters and of none. Row ``t`` uses the adapter in slot
``row_slots[t]`` (-1: no adapter) of stacked weights ``A`` ``[slots, r, in]`` and ``B``
``[slots, out, r]``, scaled by ``scalings[slot]``::

    y[t] = base[t] + scalings[s] * (x[t] @ A[s].T) @ B[s].T     (s = row_slots[t] >= 0)

:func:`lora_add_reference` computes it row by row (the reference); :func:`lora_add` groups
the rows by slot once per batch (:class:`LoraRows`) and runs two GEMMs per distinct adapter,
so its cost grows with the number of adapters in the batch, not the number of rows.
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
