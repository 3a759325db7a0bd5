"""Batched LoRA matmul: each row of a packed batch adds its own adapter's low-rank update.

A batch mixes requests of several adapters and of none. Row ``t`` uses the adapter in slot
``row_slots[t]`` (-1: no adapter) of stacked weights ``A`` ``[slots, r, in]`` and ``B``
``[slots, out, r]``, scaled by ``scalings[slot]``::

    y[t] = base[t] + scalings[s] * (x[t] @ A[s].T) @ B[s].T     (s = row_slots[t] >= 0)

:func:`lora_add_reference` computes it row by row (the reference); :func:`lora_add` plans
the rows once per batch (:class:`LoraRows`): a long run of consecutive rows of one adapter
(a prefill chunk of one request) runs its two GEMMs on views of the batch and adds into
``base`` in place, with no gather or scatter; the other rows (decode riders, short chunks)
are grouped by slot, two GEMMs per distinct adapter, so the cost grows with the number of
adapters and runs in the batch, not the number of rows.

:func:`lora_add_segments` is the decode form: one opaque op (``radixray_lora::add_segments``,
with a shape-only fake) that torch.compile keeps as a single call in a compiled decode
step (engine/executor/compiled_decode.py), eager or compiled the same computation. The
rows with an adapter are grouped by slot once per batch and each group padded to the
largest (:class:`LoraSegments`); the op gathers them into ``[groups, width, in]``, runs one
batched GEMM for the shrink and one for the expand (each row against its own adapter
only, each slot in use read once) and gathers each row's update back beside a zero row
for the rows without one: no scatter, whose CPU kernel was the slowest part of the
earlier form. (The forms tried and their times: docs/benchmarks.md.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Rows of one adapter in a row at least this long run as a view of the batch: below it, the
# GEMMs of many short runs cost more than gathering their rows with the others of their slot.
MIN_RUN_ROWS = 16


@dataclass
class LoraRows:
    """The rows of a packed batch planned once per forward pass; every LoRA layer reuses it.
    ``runs``: ``(slot, start, end)`` for each run of at least :data:`MIN_RUN_ROWS`
    consecutive rows of one adapter (updated through views). ``groups``: the remaining rows
    with an adapter, ``(slot, rows)`` per slot, the rows an int64 index tensor, or None when
    that slot covers every row of a batch too short for a run (no gather or scatter)."""

    groups: list[tuple[int, torch.Tensor | None]]
    num_rows: int
    runs: list[tuple[int, int, int]] = field(default_factory=list)

    @classmethod
    def of(cls, row_slots: torch.Tensor) -> LoraRows:
        """Plan ``row_slots`` ``[T]`` (-1: no adapter)."""
        n = int(row_slots.numel())
        if n == 0:
            return cls([], 0)
        change = (row_slots[1:] != row_slots[:-1]).nonzero().flatten() + 1
        bounds = [0, *change.tolist(), n]
        starts = torch.tensor(bounds[:-1])
        runs = [(slot, start, end) for slot, start, end
                in zip(row_slots[starts].tolist(), bounds[:-1], bounds[1:])
                if slot >= 0 and end - start >= MIN_RUN_ROWS]
        rest = row_slots
        if runs:
            rest = row_slots.clone()
            for _, start, end in runs:
                rest[start:end] = -1
        slots = [int(s) for s in torch.unique(rest).tolist() if s >= 0]
        if len(slots) == 1 and bool((rest == slots[0]).all()):
            return cls([(slots[0], None)], n, runs)
        return cls([(s, (rest == s).nonzero().flatten()) for s in slots], n, runs)


def lora_add(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             scalings: torch.Tensor, rows: LoraRows) -> torch.Tensor:
    """``base`` ``[T, out]`` plus each row's adapter update of ``x`` ``[T, in]`` (see the module
    docstring); ``a`` ``[slots, r, in]``, ``b`` ``[slots, out, r]``, ``scalings`` ``[slots]``
    (a CPU float tensor). Adds into ``base`` in place and returns it."""
    for slot, start, end in rows.runs:
        _add_rows(base[start:end], x[start:end], a[slot], b[slot], float(scalings[slot]))
    for slot, idx in rows.groups:
        scale = float(scalings[slot])
        if idx is None:
            _add_rows(base, x, a[slot], b[slot], scale)
        else:
            delta = (x.index_select(0, idx) @ a[slot].T) @ b[slot].T
            base.index_add_(0, idx, delta.to(base.dtype), alpha=scale)
    return base


def _add_rows(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              scale: float) -> None:
    """``base += scale * (x @ a.T) @ b.T`` in place (``base`` may be a view of the batch)."""
    if base.dtype == a.dtype:
        base.addmm_(x @ a.T, b.T, alpha=scale)  # the add in the GEMM
    else:
        base.add_((x @ a.T) @ b.T, alpha=scale)


@dataclass
class LoraSegments:
    """A decode batch's rows that use an adapter, grouped by slot (ascending) and padded to
    the largest group, built once per batch. Group ``g`` holds slot ``slots[g]``'s rows at
    ``gather[g*width:(g+1)*width]`` (a short group repeats its first row: the padding's
    results are never read); ``places`` ``[T]`` gives each row's index into ``gather``, or
    ``n*width`` (a zero row) for a row without an adapter; ``scales`` ``[n]`` are the groups'
    scalings in the weights' dtype."""

    gather: torch.Tensor
    slots: torch.Tensor
    scales: torch.Tensor
    places: torch.Tensor

    @classmethod
    def of(cls, row_slots: torch.Tensor, scalings: torch.Tensor,
           dtype: torch.dtype) -> LoraSegments:
        """The segments of ``row_slots`` ``[T]`` (-1: no adapter) with ``scalings`` ``[slots]``."""
        total = row_slots.numel()
        slots, counts = torch.unique(row_slots[row_slots >= 0], return_counts=True)
        n = slots.numel()
        places = torch.zeros(total, dtype=torch.int64)
        if not n:
            return cls(places[:0], slots, scalings[:0].to(dtype), places)
        width = int(counts.max())
        rows = torch.argsort(row_slots, stable=True)[total - int(counts.sum()):]  # -1 first
        group = torch.repeat_interleave(torch.arange(n), counts)
        starts = counts.cumsum(0) - counts
        place = group * width + torch.arange(rows.numel()) - starts[group]
        gather = rows[starts].repeat_interleave(width)
        gather[place] = rows
        places.fill_(n * width)
        places[rows] = place
        return cls(gather, slots, scalings[slots].to(dtype), places)


def lora_add_segments(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      segments: LoraSegments) -> torch.Tensor:
    """``base`` ``[T, out]`` plus each row's adapter update of ``x`` ``[T, in]`` (the module
    docstring), ``a`` ``[slots, r, in]``, ``b`` ``[slots, out, r]``; a new tensor."""
    return torch.ops.radixray_lora.add_segments(base, x, a, b, segments.gather, segments.slots,
                                                segments.scales, segments.places)


@torch.library.custom_op("radixray_lora::add_segments", mutates_args=())
def _add_segments(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  gather: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor,
                  places: torch.Tensor) -> torch.Tensor:
    n = slots.numel()
    if not n:
        return base.clone()
    width = gather.numel() // n
    if int(slots[-1]) == n - 1:  # the first n slots: views, no copy
        a, b = a[:n], b[:n]
    else:
        a, b = a.index_select(0, slots), b.index_select(0, slots)
    shrink = torch.bmm(x.index_select(0, gather).view(n, width, -1), a.transpose(1, 2))
    shrink.mul_(scales.view(n, 1, 1))
    delta = torch.bmm(shrink, b.transpose(1, 2)).view(n * width, -1)
    delta = torch.cat((delta, delta.new_zeros(1, delta.shape[1]))).index_select(0, places)
    return base + delta.to(base.dtype)


@_add_segments.register_fake
def _(base, x, a, b, gather, slots, scales, places):
    return torch.empty_like(base)


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
