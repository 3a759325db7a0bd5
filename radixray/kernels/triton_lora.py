"""The batched LoRA matmul in triton: segmented shrink and expand GEMMs.

Computes :func:`radixray.kernels.lora.lora_add` (reference: ``lora_add_reference``): each
row ``t`` of a packed batch adds ``scalings[s] * (x[t] @ A[s].T) @ B[s].T`` for its
adapter slot ``s`` (-1: nothing). The rows of one request are consecutive, so the batch
is cut into segments of consecutive rows with one slot (:func:`lora_segments`), and every
program works on one block of one segment with that segment's adapter:

1. ``_shrink`` -> ``tmp [T, R] = x[rows] @ A[slot].T`` (fp32 accumulation; rows of
   segments without an adapter are skipped, never read);
2. ``_expand`` -> ``base[rows, n-tile] += scale * tmp[rows] @ B[slot][n-tile].T``, in place.

fp32 operands use IEEE fp32 ``tl.dot`` (not TF32); bf16 ones are cast to fp32 inside the
kernels (triton's interpreter computes bf16 dots wrongly). Importing this module imports
triton; ``radixray.kernels`` itself never does. On a machine without a GPU the kernels run
under the interpreter: set ``TRITON_INTERPRET=1`` before importing and pass CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def lora_segments(row_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Runs of equal slots in ``row_slots`` ``[T]``: ``(indptr [n+1] int32, slots [n]
    int32, longest run)``; run ``i`` is rows ``indptr[i]:indptr[i+1]`` with slot
    ``slots[i]`` (-1 included: the kernels skip it)."""
    n = row_slots.numel()
    change = torch.ones(n, dtype=torch.bool, device=row_slots.device)
    change[1:] = row_slots[1:] != row_slots[:-1]
    starts = change.nonzero().flatten()
    indptr = torch.cat((starts, torch.tensor([n], device=row_slots.device)))
    longest = int((indptr[1:] - indptr[:-1]).max()) if n else 0
    return indptr.to(torch.int32), row_slots[starts].to(torch.int32), longest


@triton.jit
def _shrink(x_ptr, a_ptr, tmp_ptr, indptr_ptr, slots_ptr, K, R,
            stride_xm, stride_as, stride_ar, stride_tm,
            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    seg = tl.program_id(1)
    slot = tl.load(slots_ptr + seg)
    if slot < 0:
        return
    start = tl.load(indptr_ptr + seg)
    end = tl.load(indptr_ptr + seg + 1)
    rows = start + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if start + tl.program_id(0) * BLOCK_M >= end:
        return
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xs = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :],
                     mask=(rows[:, None] < end) & (k[None, :] < K), other=0.0)
        a = tl.load(a_ptr + slot * stride_as + r[None, :] * stride_ar + k[:, None],
                    mask=(r[None, :] < R) & (k[:, None] < K), other=0.0)
        acc += tl.dot(xs.to(tl.float32), a.to(tl.float32), input_precision="ieee")
    tl.store(tmp_ptr + rows[:, None] * stride_tm + r[None, :], acc,
             mask=(rows[:, None] < end) & (r[None, :] < R))


@triton.jit
def _expand(tmp_ptr, b_ptr, out_ptr, scale_ptr, indptr_ptr, slots_ptr, N, R,
            stride_tm, stride_bs, stride_bn, stride_om,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    seg = tl.program_id(2)
    slot = tl.load(slots_ptr + seg)
    if slot < 0:
        return
    start = tl.load(indptr_ptr + seg)
    end = tl.load(indptr_ptr + seg + 1)
    if start + tl.program_id(0) * BLOCK_M >= end:
        return
    rows = start + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    t = tl.load(tmp_ptr + rows[:, None] * stride_tm + r[None, :],
                mask=(rows[:, None] < end) & (r[None, :] < R), other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + cols[None, :] * stride_bn + r[:, None],
                mask=(cols[None, :] < N) & (r[:, None] < R), other=0.0)
    delta = tl.dot(t, b.to(tl.float32), input_precision="ieee") * tl.load(scale_ptr + slot)
    mask = (rows[:, None] < end) & (cols[None, :] < N)
    ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    old = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (old.to(tl.float32) + delta).to(old.dtype), mask=mask)


def lora_add_triton(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    scalings: torch.Tensor, segments: tuple[torch.Tensor, torch.Tensor, int],
                    block_m: int = 16, block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """``lora_add``'s contract with the rows given as :func:`lora_segments`; ``scalings``
    on ``x``'s device. Adds into ``base`` (contiguous rows) in place and returns it."""
    indptr, slots, longest = segments
    rows, k = x.shape
    r, n = a.shape[1], b.shape[1]
    if rows == 0 or longest == 0:
        return base
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    tmp = torch.empty(rows, r, dtype=torch.float32, device=x.device)
    block_r = max(16, triton.next_power_of_2(r))
    m_blocks = triton.cdiv(longest, block_m)
    _shrink[(m_blocks, slots.numel())](
        x, a, tmp, indptr, slots, k, r, x.stride(0), a.stride(0), a.stride(1), tmp.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k)
    _expand[(m_blocks, triton.cdiv(n, block_n), slots.numel())](
        tmp, b, base, scalings.to(x.device, torch.float32), indptr, slots, n, r, tmp.stride(0),
        b.stride(0), b.stride(1), base.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r)
    return base
