"""Plain-torch references for the paged-attention kernels in ``triton_attention``.

These functions *are* the contract: the triton kernels must agree with them (up to fp32
rounding order, or bf16 rounding of the softmax weights). They are slow (a Python loop
over requests) and meant for tests and documentation, not serving. No triton here.

The KV pool
-----------
One layer's key (or value) pool is ``[num_pages, page_size, num_kv_heads, head_dim]``; a
``[num_slots, num_kv_heads, head_dim]`` tensor is accepted as page size 1. Token slot
``s`` lives at page ``s // page_size``, offset ``s % page_size``. A request's pages are
``page_indices[page_indptr[b]:page_indptr[b + 1]]``, in token order and anywhere in the
pool; its tokens are the first ``seq_len`` positions over those pages (the last page
may be partly filled).

Pools are float32, bfloat16, float8_e5m2 or float8_e4m3fn. A pool may carry per-tensor
scales ``k_scale`` / ``v_scale`` (a float, a one-element tensor, or None for 1.0):
``real value = stored value * scale``. Scales apply whatever the pool dtype; in practice
only fp8 pools have them. Queries are float32 or bfloat16; outputs have q's dtype and
every softmax is computed in float32.
"""

from __future__ import annotations

import torch

# The largest finite value of each fp8 pool dtype: stores saturate here instead of
# overflowing to inf (torch's plain cast does the latter).
FP8_MAX = {torch.float8_e5m2: 57344.0, torch.float8_e4m3fn: 448.0}


def as_pages(pool: torch.Tensor) -> torch.Tensor:
    """``pool`` as ``[num_pages, page_size, num_kv_heads, head_dim]`` (a 3-D pool is page size 1)."""
    if pool.dim() == 3:
        return pool.unsqueeze(1)
    if pool.dim() != 4:
        raise ValueError(f"a KV pool is 3-D or 4-D, got shape {tuple(pool.shape)}")
    return pool


def scale_value(scale) -> float:
    """A pool scale (None, float or one-element tensor) as a Python float."""
    return 1.0 if scale is None else float(scale)


def gather_tokens(pool: torch.Tensor, pages: torch.Tensor, num_tokens: int, scale=None) -> torch.Tensor:
    """The first ``num_tokens`` tokens over ``pages`` of ``pool``, dequantized:
    ``[num_tokens, num_kv_heads, head_dim]`` float32."""
    pool = as_pages(pool)
    tokens = pool[pages.long()].reshape(-1, pool.shape[2], pool.shape[3])[:num_tokens]
    return tokens.float() * scale_value(scale)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 attention of ``q [n, H, D]`` over ``k, v [m, KVH, D]`` (GQA: query head h reads
    kv head ``h // (H // KVH)``); ``mask [n, m]`` True where allowed. Returns ``[n, H, D]``."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), k) * sm_scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hnm,mhd->nhd", probs, v)


def decode_attention_ref(q, k_pages, v_pages, page_indptr, page_indices, seq_lens, sm_scale,
                         k_scale=None, v_scale=None, num_kv_splits=None) -> torch.Tensor:
    """One new token per request attends to its cached tokens.

    q ``[B, H, D]`` (float32 / bfloat16), H a multiple of the pool's kv heads;
    ``page_indptr [B + 1]``, ``page_indices`` (int32 / int64), ``seq_lens [B]``.
    Returns ``[B, H, D]`` in q's dtype: ``softmax(q . k * sm_scale) . v`` over the
    request's ``seq_lens[b]`` tokens. A request with ``seq_len == 0`` gets zeros (an
    empty softmax has no value; zeros rather than NaN keep padded batches harmless).
    ``num_kv_splits`` is the kernel's work split; it does not change the result.
    """
    del num_kv_splits
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        if n == 0:
            continue
        pages = page_indices[int(page_indptr[b]):int(page_indptr[b + 1])]
        k = gather_tokens(k_pages, pages, n, k_scale)
        v = gather_tokens(v_pages, pages, n, v_scale)
        out[b] = _attend(q[b : b + 1], k, v, sm_scale)[0].to(q.dtype)
    return out


def extend_attention_ref(q, k_new, v_new, k_pages, v_pages, qo_indptr, prefix_page_indptr,
                         prefix_page_indices, prefix_lens, sm_scale, k_scale=None,
                         v_scale=None) -> torch.Tensor:
    """Causal prefill of new tokens over each request's cached prefix.

    q ``[T, H, D]``: the new tokens of all requests packed, request b's rows being
    ``qo_indptr[b]:qo_indptr[b + 1]``; ``k_new, v_new [T, KVH, D]`` their keys and values
    (real values, not scaled). Request b's prefix is its first ``prefix_lens[b]`` tokens
    (possibly 0) over pages ``prefix_page_indices[prefix_page_indptr[b]:prefix_page_indptr[b + 1]]``
    of the pools. New token i of request b attends to the whole prefix and to new tokens
    0..i. Returns ``[T, H, D]`` in q's dtype.
    """
    out = torch.zeros_like(q)
    for b in range(len(prefix_lens)):
        lo, hi = int(qo_indptr[b]), int(qo_indptr[b + 1])
        n, p = hi - lo, int(prefix_lens[b])
        if n == 0:
            continue
        pages = prefix_page_indices[int(prefix_page_indptr[b]):int(prefix_page_indptr[b + 1])]
        k = torch.cat([gather_tokens(k_pages, pages, p, k_scale), k_new[lo:hi].float()])
        v = torch.cat([gather_tokens(v_pages, pages, p, v_scale), v_new[lo:hi].float()])
        rows = torch.arange(n)[:, None]
        cols = torch.arange(p + n)[None, :]
        mask = (cols < p) | (cols - p <= rows)
        out[lo:hi] = _attend(q[lo:hi], k, v, sm_scale, mask).to(q.dtype)
    return out


def to_pool(x: torch.Tensor, dtype: torch.dtype, scale=None) -> torch.Tensor:
    """``x`` as a pool of ``dtype`` with ``scale`` stores it: ``x / scale`` in float32,
    clamped to the largest finite fp8 value for fp8 dtypes, then cast (round to nearest even)."""
    y = x.float() / scale_value(scale)
    if dtype in FP8_MAX:
        y = y.clamp(-FP8_MAX[dtype], FP8_MAX[dtype])
    return y.to(dtype)


def store_kv_ref(k_pages, v_pages, slots, k, v, k_scale=None, v_scale=None) -> None:
    """Write ``k, v [N, KVH, D]`` into token slots ``slots [N]`` of the pools, in place
    (slot s = page ``s // page_size``, offset ``s % page_size``), casting as ``to_pool``."""
    kp, vp = as_pages(k_pages), as_pages(v_pages)
    slots = slots.long()
    page, offset = slots // kp.shape[1], slots % kp.shape[1]
    kp[page, offset] = to_pool(k, kp.dtype, k_scale)
    vp[page, offset] = to_pool(v, vp.dtype, v_scale)
