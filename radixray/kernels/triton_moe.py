"""Fused mixture-of-experts in triton: a grouped GEMM over token blocks sorted by expert.

Computes the engine's ``ExpertDispatcher.dispatch`` contract (engine/models/experts.py;
the plain-torch reference is ``moe_reference.fused_moe_ref``) in four steps:

1. :func:`moe_align_block_size` sorts the ``T * k`` (token, j) pairs by expert and pads
   each expert's run to a multiple of ``block_m`` with a sentinel id, so that every block
   of ``block_m`` sorted rows belongs to exactly one expert.
2. ``_moe_gemm`` (gate|up): each program takes one block of sorted rows and one tile of
   output columns, gathers the rows' tokens from ``hidden`` and multiplies them by the
   block's expert ``gate_up_proj[e]`` transposed; rows are written back in (token, j)
   order into ``[T * k, 2 * I]``.
3. ``_silu_mul_kernel``: ``silu(gate) * up`` -> ``[T * k, I]``.
4. ``_moe_gemm`` (down) with each row scaled by its top-k weight -> ``[T * k, H]``, then
   the k rows of a token are summed.

Intermediates are in ``hidden``'s dtype (each expert's product is rounded to it, as the
contract says); every GEMM accumulates in fp32. fp32 inputs use IEEE fp32 ``tl.dot``
(not TF32) so that fp32 results stay within ~1e-5 of the reference.

Importing this module imports triton; ``radixray.kernels`` itself never does. On a
machine without a GPU the kernels run under triton's interpreter: set
``TRITON_INTERPRET=1`` before this module is imported and pass CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the flat (token, j) pairs of ``topk_ids`` ``[T, k]`` by expert, in blocks.

    Returns ``(sorted_token_ids, expert_ids, num_tokens_post_padded)``:

    - ``sorted_token_ids`` int32 ``[max_blocks * block_m]``: flat pair ids ``t * k + j``,
      grouped by expert in increasing expert order (pairs of one expert in increasing id
      order); each expert's run starts at a multiple of ``block_m`` and is padded up to
      one with the sentinel ``T * k``; everything after the last run is the sentinel too.
    - ``expert_ids`` int32 ``[max_blocks]``: the expert of block ``i`` (sorted rows
      ``i * block_m .. (i + 1) * block_m``), ``-1`` for blocks past the last run.
      Experts with no pairs get no block.
    - ``num_tokens_post_padded`` int32 ``[1]``: the padded length actually used, a
      multiple of ``block_m``.

    ``max_blocks = (T * k + num_experts * (block_m - 1)) // block_m`` is the most blocks
    any routing can need, so the sizes follow from the shapes alone and nothing here
    waits on the device (the GEMM reads ``num_tokens_post_padded`` and skips the rest).

    This is bookkeeping, written with torch ops (argsort, scatter_add, cumsum,
    searchsorted) rather than a kernel: O(T * k) work, small next to the GEMMs.
    Ids outside ``[0, num_experts)`` are an error (``scatter_add_`` raises on the CPU).
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    max_blocks = (n + num_experts * (block_m - 1)) // block_m

    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts

    # Stable sort: within an expert the pairs keep increasing (token, j) order. A pair at
    # sorted position i lands at its expert's padded start plus its rank in the expert.
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(n, device=device) - start[sorted_experts]
    dest = padded_start[sorted_experts] + rank

    sorted_token_ids = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=device)
    sorted_token_ids[dest] = order.to(torch.int32)

    total = padded_end[-1:]
    block_starts = torch.arange(max_blocks, device=device) * block_m
    # The expert whose padded run [start, end) holds the block's first row: the first
    # expert whose end exceeds it (right=True steps over empty experts, whose end
    # equals the previous one's).
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True)
    expert_ids = torch.where(block_starts < total, expert_ids, -1).to(torch.int32)
    return sorted_token_ids, expert_ids, total.to(torch.int32)


@triton.jit
def _moe_gemm(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr,
    sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    N, K, num_valid,
    stride_am, stride_ak,
    stride_be, stride_bn, stride_bk,
    stride_cm, stride_cn,
    A_ROW_DIV: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr = 64,
    BLOCK_N: tl.constexpr = 64,
    BLOCK_K: tl.constexpr = 32,
):
    """``c[p, :] = (w[p] *) a[p // A_ROW_DIV, :] @ b[expert(p)].T`` for the sorted pairs p.

    Grid ``(max_blocks, cdiv(N, BLOCK_N))``: program (m, n) takes sorted rows
    ``m * BLOCK_M ..`` (all of one expert, from ``moe_align_block_size``) and output
    columns ``n * BLOCK_N ..``. ``a`` is ``[rows, K]``, ``b`` ``[E, N, K]`` (out x in),
    ``c`` ``[num_valid, N]`` indexed by pair id; ``topk_weights_ptr`` is the flat
    ``[num_valid]`` top-k weights, read only when ``MUL_ROUTED_WEIGHT``. Sentinel rows
    (id ``>= num_valid``) are neither read nor written; partial N and K tiles are masked.
    ``DOT_FP32``: widen the operands to fp32 and dot in IEEE fp32 (fp32 inputs, and
    16-bit ones under the interpreter, whose dot cannot take bf16).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # Blocks past the used length (the grid is sized for the worst routing) do nothing.
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_token_ids_ptr + offs_m).to(tl.int64)
    row_ok = pair < num_valid
    a_row = pair // A_ROW_DIV  # the token for the first GEMM, the pair itself for the second

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    # b[expert] is [N, K]; load the [BLOCK_K, BLOCK_N] tile of its transpose directly.
    b_ptrs = (b_ptr + expert * stride_be + offs_n[None, :] * stride_bn
              + offs_k[:, None] * stride_bk)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & col_ok[None, :], other=0.0)
        if DOT_FP32:
            # IEEE fp32, not TF32. For 16-bit inputs (interpreter only) the widening is
            # exact: their products are exact in fp32, and the sum is fp32 either way.
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)  # 16-bit operands on tensor cores, fp32 accumulator
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)
        acc = acc * w.to(tl.float32)[:, None]

    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# Whether the kernels were decorated under triton's interpreter (TRITON_INTERPRET=1 when
# this module was imported). Its tl.dot (3.8) is a numpy matmul of the raw storage, and
# it stores bf16 as uint16, so there 16-bit operands are widened to fp32 before the dot.
_INTERPRET = not isinstance(_moe_gemm, triton.JITFunction)


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, inter, stride_xm, stride_ym, BLOCK: tl.constexpr):
    """``y[r, :] = silu(x[r, :inter]) * x[r, inter:]``, in fp32, stored in y's dtype.
    Grid ``(rows, cdiv(inter, BLOCK))``."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    gate = tl.load(x_ptr + row * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_xm + inter + offs, mask=ok, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(y_ptr + row * stride_ym + offs, y.to(y_ptr.dtype.element_ty), mask=ok)


def silu_mul(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x`` ``[R, 2I]`` (last dim contiguous) -> ``[R, I]``."""
    rows, two_inter = x.shape
    inter = two_inter // 2
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
            x, y, inter, x.stride(0), y.stride(0), BLOCK=block)
    return y


def invoke_moe_gemm(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor,
                    topk_weights: torch.Tensor | None, sorted_token_ids: torch.Tensor,
                    expert_ids: torch.Tensor, num_tokens_post_padded: torch.Tensor,
                    a_row_div: int, block_m: int, block_n: int = 64,
                    block_k: int = 32) -> None:
    """Launch ``_moe_gemm``: ``c[p] = (topk_weights[p] *) a[p // a_row_div] @ w[e_p].T``
    for every pair ``p`` in ``sorted_token_ids`` (from :func:`moe_align_block_size` with
    the same ``block_m``). ``a`` ``[rows, K]``, ``w`` ``[E, N, K]`` of ``a``'s dtype,
    ``c`` ``[num_pairs, N]`` written in place (every pair's row, nothing else);
    ``topk_weights`` flat ``[num_pairs]`` or None for no scaling."""
    num_pairs, n = c.shape
    k = a.shape[1]
    if w.dtype != a.dtype:
        raise TypeError(f"expert weights are {w.dtype}, activations {a.dtype}: they must match")
    if w.shape[1:] != (n, k):
        raise ValueError(f"expert weights {tuple(w.shape)} do not map K={k} to N={n}")
    if min(block_m, block_n, block_k) < 16:
        raise ValueError("tl.dot needs every tile side >= 16")
    grid = (expert_ids.numel(), triton.cdiv(n, block_n))
    if grid[0] == 0:
        return
    mul = topk_weights is not None
    _moe_gemm[grid](
        a, w, c, topk_weights if mul else c,  # the pointer is unused when not mul
        sorted_token_ids, expert_ids, num_tokens_post_padded,
        n, k, num_pairs,
        a.stride(0), a.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div, MUL_ROUTED_WEIGHT=mul,
        DOT_FP32=a.dtype == torch.float32 or _INTERPRET,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def default_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: 16 when the average expert gets few pairs (decode: fewer wasted
    padded rows), up to 64 for large batches (more reuse of each weight tile)."""
    per_expert = num_pairs / max(num_experts, 1)
    if per_expert <= 16:
        return 16
    if per_expert <= 64:
        return 32
    return 64


def fused_moe(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, block_m: int | None = None,
              *, block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """The routed experts of one MoE layer: ``ExpertDispatcher.dispatch``'s contract.

    ``hidden`` ``[T, H]``; ``gate_up_proj`` ``[E, 2I, H]`` (gate rows first) and
    ``down_proj`` ``[E, H, I]`` in ``hidden``'s dtype (float32 or bfloat16; float16
    works the same); ``topk_weights`` ``[T, k]`` (any float dtype, applied in fp32);
    ``topk_ids`` ``[T, k]`` integer slots in ``[0, E)``. Returns ``[T, H]`` in
    ``hidden``'s dtype: row t is ``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}
    (hidden[t])`` with a SwiGLU expert. ``T == 0`` returns ``[0, H]`` zeros. The k
    contributions of a token are summed in slot (j) order, in fp32, then rounded.

    ``block_m`` rows per expert block (default from :func:`default_block_m`);
    ``block_n`` / ``block_k`` the output-column and reduction tiles of both GEMMs.
    All three must be powers of two >= 16 (``tl.dot``).
    """
    num_tokens, hidden_size = hidden.shape
    if num_tokens == 0:
        return hidden.new_zeros((0, hidden_size))
    num_experts, two_inter, _ = gate_up_proj.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if block_m is None:
        block_m = default_block_m(num_pairs, num_experts)

    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, num_experts, block_m)
    tiles = dict(block_m=block_m, block_n=block_n, block_k=block_k)

    # gate|up for every (token, j) pair, in pair order: row p reads token p // k.
    gate_up = torch.empty(num_pairs, two_inter, dtype=hidden.dtype, device=hidden.device)
    invoke_moe_gemm(hidden, gate_up_proj, gate_up, None, sorted_ids, expert_ids, num_post,
                    a_row_div=top_k, **tiles)
    act = silu_mul(gate_up)

    # down, scaled by the pair's top-k weight; row p reads act[p].
    down = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    invoke_moe_gemm(act, down_proj, down, topk_weights.reshape(-1).contiguous(), sorted_ids,
                    expert_ids, num_post, a_row_div=1, **tiles)
    return down.view(num_tokens, top_k, hidden_size).sum(1, dtype=torch.float32).to(hidden.dtype)
