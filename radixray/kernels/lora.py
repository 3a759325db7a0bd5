"""Batched LoRA matmul: each row of a packed batch adds its own adapter's low-rank update.

A batch mixes requests of several adapters and of none. Row ``t`` uses the adapter in slot
``row_slots[t]`` (-1: no adapter) of stacked weights ``A`` ``[slots, r, in]`` and ``B``
``[slots, out, r]``, scaled by ``scalings[slot]``::

    y[t] = base[t] + scalings[s] * (x[t] @ A[s].T) @ B[s].T     (s = row_slots[t] >= 0)

:func:`lora_add_reference` computes it row by row (the reference); :func:`lora_add` plans
the rows once per batch (:class:`LoraRows`): a long run of consecutive rows of one adapter
(a prefill chunk of one request) runs its two GEMMs on views of the batch and adds into
``base`` in place, with no gather or scatter (a fused target's expand by parts, on the
diagonal blocks of its B, once the run is long enough to gain from skipping the zero
blocks); the other rows (decode riders, short chunks) are grouped by slot, two GEMMs per
distinct adapter, so the cost grows with the number of adapters and runs in the batch, not
the number of rows.

:func:`lora_add_segments` is the decode form: one opaque op (``radixray_lora::add_segments``,
with a shape-only fake) that torch.compile keeps as a single call in a compiled decode
step (engine/executor/compiled_decode.py), eager or compiled the same computation. The
batch is planned once (:class:`LoraSegments`). When each adapter's rows are one run of
consecutive rows (the scheduler keeps its running requests grouped by adapter slot), the
op works on views of the batch: runs of equal length over adjacent slots take one batched
GEMM for the shrink and one for the expand, added into the output in place; other runs
take their own two GEMMs. Otherwise the rows are grouped by slot and each group padded to
the largest; the op gathers them into ``[groups, width, in]``, runs the two batched GEMMs
(each row against its own adapter only, each slot in use read once) and gathers each
row's update back beside a zero row for the rows without one: no scatter, whose CPU
kernel was the slowest part of an earlier form. (The forms tried and their times:
docs/benchmarks.md.)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

# Rows of one adapter in a row at least this long run as a view of the batch: below it, the
# GEMMs of many short runs cost more than gathering their rows with the others of their slot.
MIN_RUN_ROWS = 16
# A run at least this long expands a fused target's parts (q|k|v, gate|up) one by one on
# B's diagonal blocks, skipping its zero blocks; below it one GEMM over the whole
# block-diagonal B is faster (docs/benchmarks.md, "LoRA expand by parts";
# bench/lora_forms.py --compare expand-parts). The two agree to rounding (the whole B's GEMM
# sums its zero blocks too, in its own order), as any two GEMM shapes may.
MIN_PART_ROWS = 128
# A run at least this long shrinks on int8 codes in an int8 engine (Int8Shrink); below it the
# int8 GEMM and its rescale cost more than the fp32 GEMM (a 576 x 48 shrink: 21 vs 14 us at
# 8 rows, 27 vs 34 us at 64, 71 vs 195 us at 512 on an AVX-512 VNNI EPYC; docs/benchmarks.md).
MIN_INT8_ROWS = 64


@dataclass
class LoraRows:
    """The rows of a packed batch planned once per forward pass; every LoRA layer reuses it.
    ``runs``: ``(slot, start, end)`` for each run of consecutive rows of one adapter updated
    through views of the batch: every run of at least :data:`MIN_RUN_ROWS` rows, and the one
    run of a slot that has no other rows. ``groups``: the remaining rows with an adapter,
    ``(slot, rows)`` per slot, the rows an int64 index tensor."""

    groups: list[tuple[int, torch.Tensor]]
    num_rows: int
    runs: list[tuple[int, int, int]] = field(default_factory=list)

    @classmethod
    def of(cls, row_slots: torch.Tensor) -> LoraRows:
        """Plan ``row_slots`` ``[T]`` (-1: no adapter)."""
        n = int(row_slots.numel())
        spans = adapter_spans(row_slots)
        per_slot = Counter(slot for slot, _, _ in spans)
        runs, rest = [], {}
        for slot, start, end in spans:
            if per_slot[slot] == 1 or end - start >= MIN_RUN_ROWS:
                runs.append((slot, start, end))
            else:
                rest.setdefault(slot, []).append(torch.arange(start, end))
        return cls([(slot, torch.cat(parts)) for slot, parts in sorted(rest.items())], n, runs)


def adapter_spans(row_slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(slot, start, end)`` of each maximal run of consecutive rows of one adapter in
    ``row_slots`` ``[T]`` (rows of slot -1, no adapter, are left out), in row order."""
    n = int(row_slots.numel())
    if n == 0:
        return []
    change = (row_slots[1:] != row_slots[:-1]).nonzero().flatten() + 1
    bounds = [0, *change.tolist(), n]
    slots = row_slots[torch.tensor(bounds[:-1])].tolist()
    return [(slot, start, end) for slot, start, end in zip(slots, bounds[:-1], bounds[1:])
            if slot >= 0]


@dataclass
class Int8Shrink:
    """An int8 engine's shrink operands (its base projections are w8a8 int8): the batch's
    activation codes ``x_q`` ``[T, in]`` int8 and per-row scales ``x_scale`` ``[T]``, as the
    base projection quantized them, and the slots' A as per-row codes ``a_q``
    ``[slots, width, in]`` int8 with scales ``a_scale`` ``[slots, width]`` (LoraSlots keeps
    them beside A). A run's shrink is then one int8 GEMM on the codes, rescaled: ``x @ A.T``
    to the two quantizations' rounding, 2.7x faster than fp32's at a 512-row run on an
    AVX-512 VNNI EPYC, rescale included (docs/benchmarks.md)."""

    x_q: torch.Tensor
    x_scale: torch.Tensor
    a_q: torch.Tensor
    a_scale: torch.Tensor

    def shrink(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Rows ``start:end``'s shrink by slot ``slot``'s A: fp32 ``[end - start, width]``."""
        acc = torch._int_mm(self.x_q[start:end], self.a_q[slot].t())
        return acc.float().mul_(self.x_scale[start:end, None]).mul_(self.a_scale[slot])


def lora_add(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             scalings: torch.Tensor, rows: LoraRows,
             parts: tuple[int, ...] | None = None, int8: Int8Shrink | None = None) -> torch.Tensor:
    """``base`` ``[T, out]`` plus each row's adapter update of ``x`` ``[T, in]`` (see the module
    docstring); ``a`` ``[slots, r, in]``, ``b`` ``[slots, out, r]``, ``scalings`` ``[slots]``
    (a CPU float tensor). ``parts``: the output widths of a fused target whose ``b`` is
    block-diagonal (``len(parts)`` blocks of ``r / len(parts)`` columns, as LoraSlots stacks
    q|k|v and gate|up); a long run then skips the zero blocks. ``int8``: the shrinks of runs
    of :data:`MIN_INT8_ROWS` rows and more as int8 GEMMs (:class:`Int8Shrink`; shorter runs
    and the grouped rows keep fp32). Adds into ``base`` in place and returns it."""
    for slot, start, end in rows.runs:
        shrink = (int8.shrink(slot, start, end)
                  if int8 is not None and end - start >= MIN_INT8_ROWS
                  else x[start:end] @ a[slot].T)
        if parts is not None and len(parts) > 1 and end - start >= MIN_PART_ROWS:
            _expand_by_part(base[start:end], shrink, b[slot], float(scalings[slot]), parts)
            continue
        _expand_into(base[start:end], shrink, b[slot].T, float(scalings[slot]))
    for slot, idx in rows.groups:
        delta = (x.index_select(0, idx) @ a[slot].T) @ b[slot].T
        base.index_add_(0, idx, delta.to(base.dtype), alpha=float(scalings[slot]))
    return base


def _add_rows(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              scale: float) -> None:
    """``base += scale * (x @ a.T) @ b.T`` in place (``base`` may be a view of the batch)."""
    _expand_into(base, x @ a.T, b.T, scale)


def _expand_into(out: torch.Tensor, shrink: torch.Tensor, b_t: torch.Tensor,
                 scale: float) -> None:
    """``out += scale * shrink @ b_t`` in place, the add inside the GEMM when the dtypes
    allow it."""
    if out.dtype == b_t.dtype:
        out.addmm_(shrink, b_t, alpha=scale)
    else:
        out.add_(shrink @ b_t, alpha=scale)


def _expand_by_part(base: torch.Tensor, shrink: torch.Tensor, b: torch.Tensor, scale: float,
                    parts: tuple[int, ...]) -> None:
    """``base += scale * shrink @ b.T`` for a block-diagonal ``b`` ``[sum(parts), len(parts)
    * r]``: each part's columns of ``base`` take one GEMM with its own ``r`` columns of the
    shrink and its diagonal block of ``b`` (strided views, no copies), so the zero blocks
    cost nothing."""
    rank = shrink.shape[1] // len(parts)
    start = 0
    for i, width in enumerate(parts):
        cols = slice(i * rank, (i + 1) * rank)
        _expand_into(base[:, start:start + width], shrink[:, cols],
                     b[start:start + width, cols].T, scale)
        start += width


@dataclass
class LoraSegments:
    """A decode batch's rows that use an adapter, planned once per batch, in one of two forms.

    Runs (each slot's rows consecutive, as the scheduler orders its running requests):
    ``runs`` ``[n, 3]`` holds each run's ``(slot, start, end)`` in row order, ``slots`` and
    ``scales`` each run's slot and scaling; ``gather`` and ``places`` are empty.

    Groups (otherwise): ``runs`` is empty; the rows are grouped by slot (ascending) and padded
    to the largest group. Group ``g`` holds slot ``slots[g]``'s rows at
    ``gather[g*width:(g+1)*width]`` (a short group repeats its first row: the padding's
    results are never read); ``places`` ``[T]`` gives each row's index into ``gather``, or
    ``n*width`` (a zero row) for a row without an adapter.

    ``scales`` ``[n]`` are in the weights' dtype."""

    gather: torch.Tensor
    slots: torch.Tensor
    scales: torch.Tensor
    places: torch.Tensor
    runs: torch.Tensor

    @classmethod
    def of(cls, row_slots: torch.Tensor, scalings: torch.Tensor, dtype: torch.dtype,
           runs: bool = True) -> LoraSegments:
        """The segments of ``row_slots`` ``[T]`` (-1: no adapter) with ``scalings`` ``[slots]``:
        the runs form where the rows allow it (``runs`` False: always the groups form, which
        bench/lora_forms.py compares it with)."""
        spans = adapter_spans(row_slots) if runs else []
        if spans and len({slot for slot, _, _ in spans}) == len(spans):  # one run per slot
            runs = torch.tensor(spans, dtype=torch.int64)
            slots = torch.tensor([slot for slot, _, _ in spans], dtype=torch.int64)  # no view
            # two empty tensors, not one twice: the compiled step must not see them aliased
            return cls(torch.zeros(0, dtype=torch.int64), slots, scalings[slots].to(dtype),
                       torch.zeros(0, dtype=torch.int64), runs)
        no_runs = torch.zeros(0, 3, dtype=torch.int64)
        total = row_slots.numel()
        slots, counts = torch.unique(row_slots[row_slots >= 0], return_counts=True)
        n = slots.numel()
        places = torch.zeros(total, dtype=torch.int64)
        if not n:
            return cls(places[:0], slots, scalings[:0].to(dtype), places, no_runs)
        width = int(counts.max())
        rows = torch.argsort(row_slots, stable=True)[total - int(counts.sum()):]  # -1 first
        group = torch.repeat_interleave(torch.arange(n), counts)
        starts = counts.cumsum(0) - counts
        place = group * width + torch.arange(rows.numel()) - starts[group]
        gather = rows[starts].repeat_interleave(width)
        gather[place] = rows
        places.fill_(n * width)
        places[rows] = place
        return cls(gather, slots, scalings[slots].to(dtype), places, no_runs)


def lora_add_segments(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      segments: LoraSegments) -> torch.Tensor:
    """``base`` ``[T, out]`` plus each row's adapter update of ``x`` ``[T, in]`` (the module
    docstring), ``a`` ``[slots, r, in]``, ``b`` ``[slots, out, r]``; a new tensor."""
    return torch.ops.radixray_lora.add_segments(base, x, a, b, segments.gather, segments.slots,
                                                segments.scales, segments.places, segments.runs)


@torch.library.custom_op("radixray_lora::add_segments", mutates_args=())
def _add_segments(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  gather: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor,
                  places: torch.Tensor, runs: torch.Tensor) -> torch.Tensor:
    if runs.numel():
        return _add_runs(base, x, a, b, runs.tolist(), slots, scales)
    n = slots.numel()
    if not n:
        return base.clone()
    width = gather.numel() // n
    first = int(slots[0])  # the slots ascend: consecutive when the last is n - 1 on
    a, b = _slot_weights(a, b, slots, first, int(slots[-1]) == first + n - 1)
    shrink = torch.bmm(x.index_select(0, gather).view(n, width, -1), a.transpose(1, 2))
    shrink.mul_(scales.view(n, 1, 1))
    delta = torch.bmm(shrink, b.transpose(1, 2)).view(n * width, -1)
    delta = torch.cat((delta, delta.new_zeros(1, delta.shape[1]))).index_select(0, places)
    return base + delta.to(base.dtype)


@_add_segments.register_fake
def _(base, x, a, b, gather, slots, scales, places, runs):
    return torch.empty_like(base)


def _slot_weights(a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                  first: int, consecutive: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` of ``slots`` (``first`` the first of them) stacked in their order:
    views when the slots are ``consecutive`` and ascending, else gathered copies."""
    if consecutive:
        return a[first:first + slots.numel()], b[first:first + slots.numel()]
    return a.index_select(0, slots), b.index_select(0, slots)


def _add_runs(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              runs: list[list[int]], slots: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The runs form of :func:`_add_segments`: runs of one length laid end to end take one
    batched GEMM each for the shrink and the expand on views of ``x`` and the output; other
    runs take two GEMMs each."""
    out = base.clone(memory_format=torch.contiguous_format)
    (first, start, stop), n = runs[0], len(runs)
    width = stop - start
    if n == 1 or any(r[1] != start + i * width or r[2] - r[1] != width
                     for i, r in enumerate(runs)):
        for (slot, lo, hi), scale in zip(runs, scales.tolist()):
            _add_rows(out[lo:hi], x[lo:hi], a[slot], b[slot], scale)
        return out
    end = start + n * width
    consecutive = all(r[0] == first + i for i, r in enumerate(runs))
    a, b = _slot_weights(a, b, slots, first, consecutive)
    shrink = torch.bmm(x[start:end].reshape(n, width, -1), a.transpose(1, 2))
    shrink.mul_(scales.view(n, 1, 1))
    block = out[start:end].view(n, width, -1)
    if out.dtype == b.dtype:
        block.baddbmm_(shrink, b.transpose(1, 2))
    else:
        block.add_(torch.bmm(shrink, b.transpose(1, 2)).to(out.dtype))
    return out


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
