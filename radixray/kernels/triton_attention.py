"""Triton paged-attention kernels for CUDA GPUs: decode, extend (prefill) and the KV store.

The contracts (shapes, dtypes, pool layout, fp8 scales) are those of the plain-torch
references in ``attention_reference.py``; the tests check one against the other under
``TRITON_INTERPRET=1``. This module imports triton at its top, so it is imported only
when the triton attention backend is chosen (``import radixray.kernels`` does not).

* ``decode_attention``: flash decoding. Stage 1 splits each request's tokens into
  ``num_kv_splits`` chunks; one program per (request, kv head, chunk) computes, for all
  query heads sharing that kv head, the chunk's softmax-normalised output and its
  log-sum-exp. Stage 2 merges the chunks per (request, head) with the log-sum-exp trick.
* ``extend_attention``: flash attention per (request, query head, block of new tokens):
  first over the cached prefix read from the pool through the page table, then over the
  request's new keys with the causal mask.
* ``store_kv``: writes new keys and values into token slots, quantizing for fp8 pools.

Numerics: every dot product accumulates in float32 and softmax statistics are float32.
Scores use base 2 (``exp2`` with ``log2(e)`` folded into the scale), the cheap native
exponential on GPUs. K is fed to the tensor cores in q's dtype (fp8 -> bf16 is exact);
the softmax weights are rounded to q's dtype before the weighted sum of V, as in
flash attention, so bf16 outputs differ from the fp32 reference by ~1e-2 relative.

Under triton 3.8's interpreter two things differ from a GPU (see ``_dot_in_fp32`` and
``store_kv``): bf16 tl.dot is worked around by widening to fp32, and float downcasts
there truncate instead of rounding to nearest even (harmless within bf16 tolerances in
attention; ``store_kv`` lets torch do its final cast so pool contents are exact).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .attention_reference import FP8_MAX, as_pages, scale_value

LOG2E = 1.4426950408889634

# Tile sizes. Decode is bandwidth-bound: 64 tokens per K/V tile. Extend: 64 query rows by
# 64 keys keeps the fp32 accumulator and the scores tile in registers for head_dim <= 128.
DECODE_BLOCK_N = 64
EXTEND_BLOCK_M = 64
EXTEND_BLOCK_N = 64
# Default split-K for decode: about this many tokens per split, at most this many splits.
TOKENS_PER_SPLIT = 256
MAX_KV_SPLITS = 16
# tl.dot needs every dimension >= 16 on NVIDIA tensor cores.
MIN_DOT = 16


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _dot_in_fp32(q: torch.Tensor) -> bool:
    """Whether the kernels' tl.dot runs on float32 operands (exact IEEE products) rather
    than on q's dtype. Always for fp32 q: "ieee" precision, not TF32, to meet 1e-5.
    Also under the interpreter: it multiplies bfloat16 operands' raw uint16 bits in
    tl.dot (triton 3.8), so bf16 operands are widened first; the values are the same
    bf16 numbers, so the result equals the GPU's bf16 MMA with an fp32 accumulator."""
    return q.dtype == torch.float32 or _interpreting()


@triton.jit
def _mma(a, b, DOT_FP32: tl.constexpr):
    """``a @ b`` accumulated in float32."""
    if DOT_FP32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, out_dtype=tl.float32)
    return out


@triton.jit
def _page_slots(PAGE_INDICES, page_begin, pos, valid, PAGE_SIZE: tl.constexpr):
    """(page, offset in page), int64, of token positions ``pos`` of a request whose page
    list starts at ``PAGE_INDICES + page_begin``; page 0 where not ``valid``."""
    page = tl.load(PAGE_INDICES + page_begin + pos // PAGE_SIZE, mask=valid, other=0)
    return page.to(tl.int64), (pos % PAGE_SIZE).to(tl.int64)


# --------------------------------------------------------------------------- decode


@triton.jit
def _paged_tile(q, K, V, PAGE_INDICES, page_begin, pos, valid, d, d_mask, kvh,
                stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                qk_scale, v_scale, m_i, l_i, acc, PAGE_SIZE: tl.constexpr,
                DOT_FP32: tl.constexpr):
    """One online-softmax step over a tile of pool tokens ``pos`` (``valid`` of them) read
    through the page table: returns the new running max, sum and weighted values."""
    tile_mask = valid[:, None] & d_mask[None, :]
    page, slot = _page_slots(PAGE_INDICES, page_begin, pos, valid, PAGE_SIZE)
    k = tl.load(K + (page * stride_kp + slot * stride_kt)[:, None] + kvh * stride_kh
                + d[None, :], mask=tile_mask, other=0.0)
    qk = _mma(q, tl.trans(k.to(q.dtype)), DOT_FP32) * qk_scale
    qk = tl.where(valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + (page * stride_vp + slot * stride_vt)[:, None] + kvh * stride_vh
                + d[None, :], mask=tile_mask, other=0.0)
    acc = acc * alpha[:, None] + _mma(p.to(q.dtype), v.to(q.dtype), DOT_FP32) * v_scale
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    Q, K, V, PAGE_INDPTR, PAGE_INDICES, SEQ_LENS, MID_O, MID_LSE,
    qk_scale, v_scale,
    stride_qb, stride_qh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_mb, stride_mh, stride_ms,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Stage 1. Program (b, kv head, split): the GROUP query heads of that kv head (padded
    to BLOCK_H rows, masked) over the split's tokens. Each K/V tile is loaded once for all
    of them. Writes the normalised partial output and its base-2 log-sum-exp."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    h_off = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + h_off
    h_mask = h_off < GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    seq_len = tl.load(SEQ_LENS + b)
    page_begin = tl.load(PAGE_INDPTR + b)
    chunk = tl.cdiv(seq_len, num_splits)  # per request, so short requests split evenly too
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    # The first tile of a non-empty split has a valid token, so m_i is finite from then
    # on and exp2(m_i - m_new) never sees -inf - -inf. Padded head rows have q = 0.
    for s in range(start, end, BLOCK_N):
        pos = s + tl.arange(0, BLOCK_N)
        valid = pos < end
        m_i, l_i, acc = _paged_tile(
            q, K, V, PAGE_INDICES, page_begin, pos, valid, d, d_mask, kvh,
            stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
            qk_scale, 1.0, m_i, l_i, acc, PAGE_SIZE, DOT_FP32)  # v_scale: at the end

    # An empty split (start >= end) stores lse = -inf and zeros; stage 2 skips it anyway.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None] * v_scale  # V's scale factors out of the weighted sum
    lse = m_i + tl.log2(l_safe)
    tl.store(MID_O + b * stride_mb + heads[:, None] * stride_mh + split * stride_ms + d[None, :],
             out, mask=h_mask[:, None] & d_mask[None, :])
    tl.store(MID_LSE + b * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def _decode_merge_kernel(
    MID_O, MID_LSE, SEQ_LENS, OUT,
    num_splits,
    stride_mb, stride_mh, stride_ms,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Stage 2. Program (b, head): out = sum_s w_s o_s / sum_s w_s, w_s = 2^(lse_s - max lse),
    over the request's non-empty splits; zeros when there are none (seq_len 0)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    seq_len = tl.load(SEQ_LENS + b)
    chunk = tl.cdiv(seq_len, num_splits)
    used = (s < num_splits) & (s * chunk < seq_len)  # the splits stage 1 gave tokens

    lse = tl.load(MID_LSE + b * stride_lb + h * stride_lh + s, mask=used, other=float("-inf"))
    o = tl.load(MID_O + b * stride_mb + h * stride_mh + s[:, None] * stride_ms + d[None, :],
                mask=used[:, None] & d_mask[None, :], other=0.0)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no used split: avoid -inf - -inf = NaN
    w = tl.where(used, tl.exp2(lse - m), 0.0)
    denom = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(OUT + b * stride_ob + h * stride_oh + d, out.to(OUT.dtype.element_ty), mask=d_mask)


def default_num_kv_splits(max_seq_len: int) -> int:
    """About TOKENS_PER_SPLIT tokens per split, a power of two (few stage-2 compilations),
    at most MAX_KV_SPLITS."""
    wanted = max(1, math.ceil(max_seq_len / TOKENS_PER_SPLIT))
    return min(MAX_KV_SPLITS, triton.next_power_of_2(wanted))


def _check_pools(k_pages: torch.Tensor, v_pages: torch.Tensor, head_dim: int):
    k4, v4 = as_pages(k_pages), as_pages(v_pages)
    if k4.shape != v4.shape:
        raise ValueError(f"key and value pools differ: {tuple(k4.shape)} vs {tuple(v4.shape)}")
    if k4.shape[3] != head_dim:
        raise ValueError(f"pool head_dim {k4.shape[3]} != query head_dim {head_dim}")
    if k4.stride(3) != 1 or v4.stride(3) != 1:
        raise ValueError("KV pools must be contiguous along head_dim")
    return k4, v4


def _block_d(head_dim: int) -> int:
    return max(MIN_DOT, triton.next_power_of_2(head_dim))


def decode_attention(q, k_pages, v_pages, page_indptr, page_indices, seq_lens, sm_scale,
                     k_scale=None, v_scale=None, num_kv_splits=None) -> torch.Tensor:
    """Paged decode attention (contract: ``attention_reference.decode_attention_ref``).

    q ``[B, H, D]`` float32/bfloat16 (contiguous along D); pools ``[num_pages, page_size,
    KVH, D]`` (or ``[num_slots, KVH, D]``) float32/bfloat16/fp8 with H a multiple of KVH;
    ``page_indptr [B + 1]``, ``page_indices``, ``seq_lens [B]`` int32/int64 on q's device.
    Returns ``[B, H, D]`` in q's dtype; zeros for a request with ``seq_len == 0``.

    ``num_kv_splits``: how many chunks each request's tokens are split into (any value
    gives the same result up to rounding). None picks ``default_num_kv_splits`` of the
    longest request, which reads ``seq_lens`` on the host (a device sync): callers in a
    CUDA graph should pass it. Scales given as tensors are read on the host too.
    """
    batch, num_heads, head_dim = q.shape
    k4, v4 = _check_pools(k_pages, v_pages, head_dim)
    page_size, num_kv_heads = k4.shape[1], k4.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if q.stride(2) != 1:
        raise ValueError("q must be contiguous along head_dim")
    group = num_heads // num_kv_heads
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    if num_kv_splits is None:
        num_kv_splits = default_num_kv_splits(int(seq_lens.max()))
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")

    mid_o = torch.empty(batch, num_heads, num_kv_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_heads, num_kv_splits, dtype=torch.float32, device=q.device)
    block_d = _block_d(head_dim)
    qk_scale = float(sm_scale) * scale_value(k_scale) * LOG2E
    _decode_split_kernel[(batch, num_kv_heads, num_kv_splits)](
        q, k4, v4, page_indptr, page_indices, seq_lens, mid_o, mid_lse,
        qk_scale, scale_value(v_scale),
        q.stride(0), q.stride(1),
        k4.stride(0), k4.stride(1), k4.stride(2),
        v4.stride(0), v4.stride(1), v4.stride(2),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        # The head group padded to a power of two >= 16 so the score and PV products are
        # tensor-core tl.dot shapes; padded rows are masked. Decode is bound by reading
        # K/V, so the idle MMA rows cost little, and K/V is read once per kv head.
        BLOCK_H=max(MIN_DOT, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=DECODE_BLOCK_N, DOT_FP32=_dot_in_fp32(q),
    )
    _decode_merge_kernel[(batch, num_heads)](
        mid_o, mid_lse, seq_lens, out, num_kv_splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_kv_splits), BLOCK_D=block_d,
    )
    return out


# --------------------------------------------------------------------------- extend


@triton.jit
def _extend_kernel(
    Q, K_NEW, V_NEW, K, V, OUT,
    QO_INDPTR, PREFIX_INDPTR, PREFIX_INDICES, PREFIX_LENS,
    qk_scale_new, qk_scale_prefix, v_scale,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Program (b, head, block of BLOCK_M new tokens of request b). The grid is sized for
    the longest request; blocks past a shorter request's end return at once."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    qo_start = tl.load(QO_INDPTR + b)
    new_len = tl.load(QO_INDPTR + b + 1) - qo_start
    if mb * BLOCK_M >= new_len:
        return
    kvh = h // GROUP

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < new_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(Q + (qo_start + rows)[:, None].to(tl.int64) * stride_qt + h * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Every row has a visible key in the first tile of either loop (any prefix token, or
    # new token 0), so m_i is finite after it: no -inf - -inf in exp2(m_i - m_new).

    # 1) The cached prefix, from the pool through the page table: visible to every row.
    prefix_len = tl.load(PREFIX_LENS + b)
    page_begin = tl.load(PREFIX_INDPTR + b)
    for s in range(0, prefix_len, BLOCK_N):
        pos = s + tl.arange(0, BLOCK_N)
        valid = pos < prefix_len
        # Pool V carries v_scale and new V does not, so it is applied per prefix tile.
        m_i, l_i, acc = _paged_tile(
            q, K, V, PREFIX_INDICES, page_begin, pos, valid, d, d_mask, kvh,
            stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
            qk_scale_prefix, v_scale, m_i, l_i, acc, PAGE_SIZE, DOT_FP32)

    # 2) The request's new tokens, causal: row i sees new tokens 0..i. Keys past this
    # block's last row are invisible to all its rows, so the loop stops there.
    kv_end = tl.minimum(new_len, (mb + 1) * BLOCK_M)
    for s in range(0, kv_end, BLOCK_N):
        cols = s + tl.arange(0, BLOCK_N)
        valid = cols < kv_end
        tile_mask = valid[:, None] & d_mask[None, :]
        tok = (qo_start + cols).to(tl.int64)
        k = tl.load(K_NEW + tok[:, None] * stride_knt + kvh * stride_knh + d[None, :],
                    mask=tile_mask, other=0.0)
        qk = _mma(q, tl.trans(k.to(q.dtype)), DOT_FP32) * qk_scale_new
        qk = tl.where(valid[None, :] & (cols[None, :] <= rows[:, None]), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_NEW + tok[:, None] * stride_vnt + kvh * stride_vnh + d[None, :],
                    mask=tile_mask, other=0.0)
        acc = acc * alpha[:, None] + _mma(p.to(q.dtype), v.to(q.dtype), DOT_FP32)
        m_i = m_new

    out = acc / l_i[:, None]  # l_i >= 1: the row's maximum contributes 2^0
    tl.store(OUT + (qo_start + rows)[:, None].to(tl.int64) * stride_ot + h * stride_oh + d[None, :],
             out.to(OUT.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def extend_attention(q, k_new, v_new, k_pages, v_pages, qo_indptr, prefix_page_indptr,
                     prefix_page_indices, prefix_lens, sm_scale, k_scale=None,
                     v_scale=None) -> torch.Tensor:
    """Causal prefill over a cached prefix (contract: ``attention_reference.extend_attention_ref``).

    q ``[T, H, D]`` float32/bfloat16 and ``k_new, v_new [T, KVH, D]`` in q's dtype, packed
    by ``qo_indptr [B + 1]``; prefix of request b: ``prefix_lens[b]`` tokens (may be 0)
    over pages ``prefix_page_indices[prefix_page_indptr[b]:prefix_page_indptr[b + 1]]`` of
    the pools, dequantized with ``k_scale`` / ``v_scale``. All three tensors contiguous
    along D. Returns ``[T, H, D]`` in q's dtype. Reads ``qo_indptr`` on the host to size
    the grid (one sync per call, fine for prefill).
    """
    num_tokens, num_heads, head_dim = q.shape
    k4, v4 = _check_pools(k_pages, v_pages, head_dim)
    page_size, num_kv_heads = k4.shape[1], k4.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if k_new.shape != (num_tokens, num_kv_heads, head_dim) or v_new.shape != k_new.shape:
        raise ValueError(f"k_new / v_new must be {(num_tokens, num_kv_heads, head_dim)}")
    if q.stride(2) != 1 or k_new.stride(2) != 1 or v_new.stride(2) != 1:
        raise ValueError("q, k_new and v_new must be contiguous along head_dim")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    batch = len(prefix_lens)
    if num_tokens == 0 or batch == 0:
        return out
    max_new = int((qo_indptr[1:] - qo_indptr[:-1]).max())
    grid = (batch, num_heads, triton.cdiv(max_new, EXTEND_BLOCK_M))
    _extend_kernel[grid](
        q, k_new, v_new, k4, v4, out,
        qo_indptr, prefix_page_indptr, prefix_page_indices, prefix_lens,
        float(sm_scale) * LOG2E, float(sm_scale) * scale_value(k_scale) * LOG2E, scale_value(v_scale),
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k4.stride(0), k4.stride(1), k4.stride(2),
        v4.stride(0), v4.stride(1), v4.stride(2),
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_M=EXTEND_BLOCK_M, BLOCK_N=EXTEND_BLOCK_N, BLOCK_D=_block_d(head_dim),
        DOT_FP32=_dot_in_fp32(q),
    )
    return out


# --------------------------------------------------------------------------- store


@triton.jit
def _store_kv_kernel(
    X, SLOTS, POOL, scale,
    stride_xn, stride_xh, stride_pp, stride_pt, stride_ph,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SATURATE: tl.constexpr, FP8_LIMIT: tl.constexpr,
):
    """Program n: token n's ``[KVH, D]`` rows -> slot SLOTS[n] of POOL, as x / scale cast
    to the pool dtype (round to nearest even), clamped to +-FP8_LIMIT first when SATURATE."""
    n = tl.program_id(0)
    slot = tl.load(SLOTS + n).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (hh[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    x = tl.load(X + n.to(tl.int64) * stride_xn + hh[:, None] * stride_xh + d[None, :], mask=mask, other=0.0)
    y = x.to(tl.float32) / scale
    if SATURATE:  # fp8 casts overflow to inf (e5m2) or NaN (e4m3fn) past the largest finite value
        y = tl.minimum(tl.maximum(y, -FP8_LIMIT), FP8_LIMIT)
    dst = POOL + (slot // PAGE_SIZE) * stride_pp + (slot % PAGE_SIZE) * stride_pt
    tl.store(dst + hh[:, None] * stride_ph + d[None, :], y.to(POOL.dtype.element_ty), mask=mask)


def store_kv(k_pages, v_pages, slots, k, v, k_scale=None, v_scale=None) -> None:
    """Write ``k, v [N, KVH, D]`` (float32/bfloat16, contiguous along D) into token slots
    ``slots [N]`` (int32/int64; slot s = page ``s // page_size``, offset ``s % page_size``)
    of the pools, in place (contract: ``attention_reference.store_kv_ref``)."""
    for x, pool, scale in ((k, k_pages, k_scale), (v, v_pages, v_scale)):
        p4 = as_pages(pool)
        num_tokens, num_kv_heads, head_dim = x.shape
        if p4.shape[2:] != x.shape[1:]:
            raise ValueError(f"rows {tuple(x.shape[1:])} do not fit pool {tuple(p4.shape)}")
        if x.stride(2) != 1 or p4.stride(3) != 1:
            raise ValueError("the rows and the pool must be contiguous along head_dim")
        if num_tokens == 0:
            continue
        target = p4
        if _interpreting() and p4.dtype != torch.float32:
            # triton 3.8's interpreter rounds float downcasts wrongly (fp32 -> bf16
            # truncates; its fp8 "RTNE" drops the carry into the exponent). A GPU's cvt
            # rounds to nearest even, as torch does, so under the interpreter the kernel
            # writes its scaled, clamped fp32 values into an fp32 copy of the pool and
            # torch casts that back (values already in the pool round-trip exactly).
            target = p4.float()
        _store_kv_kernel[(num_tokens,)](
            x, slots, target, scale_value(scale),
            x.stride(0), x.stride(1), target.stride(0), target.stride(1), target.stride(2),
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=p4.shape[1],
            BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
            SATURATE=p4.dtype in FP8_MAX, FP8_LIMIT=FP8_MAX.get(p4.dtype, 0.0),
        )
        if target is not p4:
            p4.copy_(target.to(p4.dtype))
