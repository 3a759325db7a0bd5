"""``radixray bench kernels``: the C++ CPU kernels against the torch code they replace.

Each row times one kernel and its torch counterpart on the same inputs, turn
about (``--repeats`` rounds of ``--calls`` calls each; medians), at the shapes
of the default model (SmolLM2-135M: 9 query heads, 3 kv heads, head size 64,
MLP width 1,536):

- decode attention, ``--batch`` requests x ``--context-len`` tokens over a paged
  fp32, bf16 or fp8 (e5m2) pool, against the torch backend's gather + SDPA; the
  kernel's rate is given as GB/s of pool bytes read (one layer's pool, a few MB,
  stays in L3 between calls; a real step's 30 layers come from memory, slower);
- extend (prefill) attention, a ``--prefill-len`` prompt with no cached prefix and
  128 new tokens after a 2,048-token prefix, against SDPA with a causal mask;
- the middle of an int8 gated MLP (rescale, SiLU-mul, quantize) fused against the
  three ops one after the other, at prefill (2,048 rows) and decode (``--batch``) sizes;
- the residual add fused into the next RMS norm against torch's add then the C++ norm,
  at prefill (2,048 rows) and decode (``--batch``) sizes;
- the int8 GEMMs against ``torch._int_mm`` over one decode step's worth of int8
  weights (30 layers x qkv, o, gate|up, down: 106 MB, so they come from memory):
  the AVX2 small-M kernel at 1 and 4 rows and, on CPUs with AVX-512 VNNI, the
  kernel on packed weights at 1, 8, ``--batch`` and 256 rows;
- the lm_head (49,152 x 576) as an int8 linear (``quantize_lm_head``) against the
  fp32 C++ linear, at ``--batch`` rows;
- where the CPU has them, each faster instruction set against the kernel it
  replaces: decode attention in AVX-512 against AVX2 (bf16 and fp8 pools),
  extend attention on AMX-BF16 tiles against the fp32 kernel (keys and values
  bf16-exact, as a bf16 or fp8 pool holds them), and the packed int8 GEMM on AMX
  tiles against VNNI (the GEMM rows above force VNNI on AMX machines).

Outputs are checked against each other before timing. Machines are noisy:
compare ratios from one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixray.engine.mem_cache.hugepages import empty_huge

HEADS, KV_HEADS, HEAD_DIM, INTER, HIDDEN, LAYERS, VOCAB = 9, 3, 64, 1536, 576, 30, 49152


def _paired_medians(fast: Callable, slow: Callable, calls: int, repeats: int) -> tuple[float, float]:
    """Median ms per call of ``fast`` and ``slow``, timed turn about."""
    times: dict[Callable, list[float]] = {fast: [], slow: []}
    fast(), slow()
    for _ in range(repeats):
        for fn in (fast, slow):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[fn].append((time.perf_counter() - t0) / calls * 1000)
    return statistics.median(times[fast]), statistics.median(times[slow])


def _decode_inputs(dtype: torch.dtype, batch: int, ctx: int):
    slots = batch * ctx + 1
    k_pool, v_pool = (empty_huge((slots, KV_HEADS, HEAD_DIM), dtype) for _ in range(2))
    k_pool.copy_(torch.randn(k_pool.shape)), v_pool.copy_(torch.randn(v_pool.shape))
    q = torch.randn(batch, HEADS, HEAD_DIM)
    idx = torch.arange(1, slots).view(batch, ctx)
    return q, k_pool, v_pool, idx, torch.full((batch,), ctx)


def _decode_row(ext, dtype: torch.dtype, batch: int, ctx: int, calls: int, repeats: int) -> dict:
    q, k_pool, v_pool, idx, lens = _decode_inputs(dtype, batch, ctx)
    scale = HEAD_DIM ** -0.5

    def kernel():
        return ext.paged_decode_attention(q, k_pool, v_pool, idx, lens, scale)

    def torch_backend():  # TorchAttention._decode: one gather per pool, then SDPA
        k = k_pool[idx].transpose(1, 2).float()
        v = v_pool[idx].transpose(1, 2).float()
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True).squeeze(2)

    torch.testing.assert_close(kernel(), torch_backend(), rtol=1e-4, atol=1e-4)
    fast, slow = _paired_medians(kernel, torch_backend, calls, repeats)
    pool_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * k_pool.element_size()
    return {"kernel": "decode attention", "shape": f"{batch} x {ctx} tokens, {str(dtype)[6:]} pool",
            "cpp_ms": fast, "torch_ms": slow, "rate": f"{pool_bytes / fast / 1e6:.1f} GB/s"}


def _extend_row(ext, n: int, plen: int, calls: int, repeats: int) -> dict:
    q = torch.randn(n, HEADS, HEAD_DIM)
    k, v = torch.randn(plen + n, KV_HEADS, HEAD_DIM), torch.randn(plen + n, KV_HEADS, HEAD_DIM)
    mask = torch.ones(n, plen + n, dtype=torch.bool).tril(diagonal=plen)
    scale = HEAD_DIM ** -0.5

    def kernel():
        return ext.extend_attention(q, k, v, plen, scale)

    def sdpa():
        return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1)

    torch.testing.assert_close(kernel(), sdpa(), rtol=1e-4, atol=1e-5)
    fast, slow = _paired_medians(kernel, sdpa, calls, repeats)
    pairs = n * plen + n * (n + 1) / 2  # (query, visible key) pairs
    flops = 4 * pairs * HEADS * HEAD_DIM
    return {"kernel": "extend attention", "shape": f"{n} new + {plen} cached tokens",
            "cpp_ms": fast, "torch_ms": slow, "rate": f"{flops / fast / 1e6:.1f} GFLOP/s"}


def _decode_isa_row(ext, dtype: torch.dtype, batch: int, ctx: int, calls: int, repeats: int) -> dict:
    """The decode kernel in AVX-512 against the same kernel forced to AVX2."""
    q, k_pool, v_pool, idx, lens = _decode_inputs(dtype, batch, ctx)

    def with_avx512(enabled: bool):
        def run():
            old = ext.set_decode_avx512(enabled)
            try:
                return ext.paged_decode_attention(q, k_pool, v_pool, idx, lens, HEAD_DIM ** -0.5)
            finally:
                ext.set_decode_avx512(old)
        return run

    fast_fn, slow_fn = with_avx512(True), with_avx512(False)
    torch.testing.assert_close(fast_fn(), slow_fn(), rtol=1e-5, atol=1e-5)
    fast, slow = _paired_medians(fast_fn, slow_fn, calls, repeats)
    return {"kernel": "decode AVX-512", "shape": f"{batch} x {ctx} tokens, {str(dtype)[6:]} pool",
            "cpp_ms": fast, "torch_ms": slow, "rate": "vs the AVX2 kernel"}


def _extend_amx_row(ext, n: int, plen: int, calls: int, repeats: int) -> dict:
    """Extend on AMX-BF16 tiles against the fp32 C++ kernel, keys and values bf16-exact."""
    from radixray.kernels.cpu_ops import extend_attention_bf16_ref
    q = torch.randn(n, HEADS, HEAD_DIM)
    k, v = (torch.randn(plen + n, KV_HEADS, HEAD_DIM).bfloat16().float() for _ in range(2))
    scale = HEAD_DIM ** -0.5

    def tiles():
        return ext.extend_attention_bf16(q, k, v, plen, scale)

    def fp32():
        return ext.extend_attention(q, k, v, plen, scale)

    torch.testing.assert_close(tiles(), extend_attention_bf16_ref(q, k, v, plen, scale), rtol=0, atol=2e-3)
    fast, slow = _paired_medians(tiles, fp32, calls, repeats)
    return {"kernel": "extend AMX-BF16", "shape": f"{n} new + {plen} cached tokens",
            "cpp_ms": fast, "torch_ms": slow, "rate": "vs the fp32 C++ kernel"}


def _mlp_row(ext, m: int, calls: int, repeats: int) -> dict:
    acc = torch.randint(-2**18, 2**18, (m, 2 * INTER), dtype=torch.int32)
    x_scale, w_scale = torch.rand(m) * 1e-3, torch.rand(2 * INTER) * 1e-3

    def fused():
        return ext.rescale_silu_mul_quantize(acc, x_scale, w_scale, None)

    def three_ops():
        return ext.quantize_rows_int8(ext.silu_mul(ext.rescale_int8_acc(acc, x_scale, w_scale, None)))

    assert all(torch.equal(a, b) for a, b in zip(fused(), three_ops()))
    fast, slow = _paired_medians(fused, three_ops, calls, repeats)
    return {"kernel": "int8 MLP middle", "shape": f"{m} rows", "cpp_ms": fast, "torch_ms": slow,
            "rate": "fused vs 3 C++ ops"}


def _int8_gemm_row(label: str, gemm: Callable, m: int, weights: list[torch.Tensor], calls: int,
                   repeats: int, other: Callable | None = None, other_label: str = "") -> dict:
    """``gemm(x, i)``: the kernel's product of x with weight i, against ``other`` (same
    signature; default torch._int_mm)."""
    xs = {k: torch.randint(-127, 128, (m, k), dtype=torch.int8) for k in (HIDDEN, INTER)}
    transposed = [w.t() for w in weights]  # the layout Int8Linear hands torch._int_mm

    def kernel():
        return [gemm(xs[w.shape[1]], i) for i, w in enumerate(weights)]

    def baseline():
        if other is not None:
            return [other(xs[w.shape[1]], i) for i, w in enumerate(weights)]
        return [torch._int_mm(xs[w.shape[0]], w) for w in transposed]

    assert all(torch.equal(a, b) for a, b in zip(kernel(), baseline()))
    fast, slow = _paired_medians(kernel, baseline, calls, repeats)
    total = sum(w.numel() for w in weights)
    return {"kernel": label, "shape": f"{m} rows x {len(weights)} weights",
            "cpp_ms": fast, "torch_ms": slow, "rate": f"{total / fast / 1e6:.1f} GB/s{other_label}"}


def _int8_gemm_rows(ext, vnni_rows: list[int], layers: int, calls: int, repeats: int) -> list[dict]:
    from radixray.kernels.int8_linear import amx_available, vnni_available
    shapes = [(HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HEADS * HEAD_DIM),
              (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    weights = [torch.randint(-127, 128, s, dtype=torch.int8) for _ in range(layers) for s in shapes]
    calls = max(1, calls // 10)
    rows = [_int8_gemm_row("int8 GEMM AVX2", lambda x, i: ext.int8_gemm_small_m(x, weights[i]), m, weights,
                           calls, repeats) for m in (1, 4)]
    if vnni_available(ext):
        packed = [ext.int8_vnni_pack(w) for w in weights]

        def on(amx_from_rows: int):  # the packed GEMM with AMX from this many rows
            def gemm(x, i):
                old = ext.int8_set_amx_min_rows(amx_from_rows)
                try:
                    return ext.int8_vnni_gemm(x, *packed[i], weights[i].shape[0])
                finally:
                    ext.int8_set_amx_min_rows(old)
            return gemm

        vnni, amx = on(1 << 40), on(1)
        rows += [_int8_gemm_row("int8 GEMM VNNI", vnni, m, weights, calls, repeats)
                 for m in dict.fromkeys(vnni_rows)]
        if amx_available(ext):
            rows += [_int8_gemm_row("int8 GEMM AMX", amx, m, weights, calls, repeats, vnni, ", vs VNNI")
                     for m in dict.fromkeys(vnni_rows)]
    return rows


def _gated_codes_row(ext, m: int, layers: int, calls: int, repeats: int) -> dict:
    """The gate|up projection and the MLP middle on AMX tiles in one kernel (int8_vnni_gated_codes)
    against the same three steps as separate C++ ops, over ``layers`` weights."""
    from radixray.kernels.int8_linear import Int8Linear
    gate_ups = [Int8Linear(torch.randn(2 * INTER, HIDDEN) * 0.05, None) for _ in range(layers)]
    x = torch.randn(m, HIDDEN)

    def fused():
        return [ext.int8_vnni_gated_codes(x, g.w_vnni, g.w_vnni_comp, g.w_scale, None, 2 * INTER) for g in gate_ups]

    def three_ops():
        out = []
        for g in gate_ups:
            x_q, x_scale = ext.quantize_rows_int8(x)
            acc = ext.int8_vnni_gemm(x_q, g.w_vnni, g.w_vnni_comp, 2 * INTER)
            out.append(ext.rescale_silu_mul_quantize(acc, x_scale, g.w_scale, None))
        return out

    assert all(torch.equal(a, b) for pair in zip(fused(), three_ops()) for a, b in zip(*pair))
    fast, slow = _paired_medians(fused, three_ops, calls, repeats)
    gops = 2 * m * HIDDEN * 2 * INTER * layers / 1e9
    return {"kernel": "int8 gate_up fused", "shape": f"{m} rows x {layers} weights", "cpp_ms": fast,
            "torch_ms": slow, "rate": f"{gops / fast * 1e3:.0f} GOP/s, vs 3 C++ ops"}


def _add_norm_row(ext, m: int, calls: int, repeats: int) -> dict:
    x, res, w = torch.randn(m, HIDDEN), torch.randn(m, HIDDEN), torch.randn(HIDDEN)

    def fused():
        return ext.add_rms_norm(x, res, w, 1e-5)

    def add_then_norm():
        h = res + x
        return h, ext.rms_norm(h, w, 1e-5)

    assert all(torch.equal(a, b) for a, b in zip(fused(), add_then_norm()))
    fast, slow = _paired_medians(fused, add_then_norm, calls, repeats)
    return {"kernel": "add + rms_norm", "shape": f"{m} x {HIDDEN}", "cpp_ms": fast,
            "torch_ms": slow, "rate": "vs torch add, then the C++ norm"}


def _lm_head_row(ext, m: int, calls: int, repeats: int) -> dict:
    from radixray.kernels.int8_linear import Int8Linear, int8_linear_ref
    w = torch.randn(VOCAB, HIDDEN) * 0.05
    head = Int8Linear(w, None)
    x = torch.randn(m, HIDDEN)

    def int8():
        return head(x)

    def fp32():
        return ext.linear_small_m(x, w)

    torch.testing.assert_close(int8(), int8_linear_ref(x, head.w_q, head.w_scale), rtol=1e-4, atol=1e-4)
    fast, slow = _paired_medians(int8, fp32, calls, repeats)
    return {"kernel": "lm_head int8", "shape": f"{m} rows x {VOCAB}x{HIDDEN}", "cpp_ms": fast,
            "torch_ms": slow, "rate": "vs the fp32 C++ linear"}


def run_cli(args: argparse.Namespace) -> int:
    from radixray.kernels.cpu_ops import load_extension
    ext = load_extension()
    if ext is None:
        print("the C++ CPU kernels are not available on this machine (see the log); nothing to compare")
        return 1
    rows = [_decode_row(ext, dtype, args.batch, args.context_len, args.calls, args.repeats)
            for dtype in (torch.float32, torch.bfloat16, torch.float8_e5m2)]
    rows += [_extend_row(ext, n, plen, max(1, args.calls // 4), args.repeats)
             for n, plen in ((args.prefill_len, 0), (128, 2048))]
    rows += [_mlp_row(ext, m, args.calls, args.repeats) for m in (2048, args.batch)]
    rows += [_add_norm_row(ext, m, args.calls, args.repeats) for m in (2048, args.batch)]
    vnni_rows = [int(m) for m in args.vnni_rows.split(",")] if args.vnni_rows else [1, 8, args.batch, 256]
    rows += _int8_gemm_rows(ext, vnni_rows, args.layers, args.calls, args.repeats)
    rows.append(_lm_head_row(ext, args.batch, max(1, args.calls // 4), args.repeats))
    if ext.decode_avx512_supported():
        rows += [_decode_isa_row(ext, dtype, args.batch, args.context_len, args.calls, args.repeats)
                 for dtype in (torch.bfloat16, torch.float8_e5m2)]
    if ext.int8_amx_supported():
        rows += [_gated_codes_row(ext, m, args.layers, max(1, args.calls // 10), args.repeats)
                 for m in (2048, args.prefill_len)]
    if ext.amx_bf16_supported():
        rows += [_extend_amx_row(ext, n, plen, max(1, args.calls // 4), args.repeats)
                 for n, plen in ((args.prefill_len, 0), (128, 2048))]
    print(f"\nthreads={torch.get_num_threads()}, medians of {args.repeats} rounds, turn about")
    print(f"{'kernel':<18} {'shape':<32} {'C++ ms':>8} {'other ms':>9} {'speedup':>8}  rate")
    for r in rows:
        r["speedup"] = r["torch_ms"] / r["cpp_ms"]
        print(f"{r['kernel']:<18} {r['shape']:<32} {r['cpp_ms']:>8.3f} {r['torch_ms']:>9.3f} "
              f"{r['speedup']:>7.2f}x  {r['rate']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "rows": rows}, f, indent=2)
    return 0


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Add the ``kernels`` subcommand; its ``func`` is :func:`run_cli`."""
    p = bench_subparsers.add_parser(
        "kernels", help="C++ CPU kernels against the torch code they replace",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32, help="decode requests (and MLP decode rows)")
    p.add_argument("--context-len", type=int, default=576, help="tokens per decode request")
    p.add_argument("--prefill-len", type=int, default=512, help="new tokens of the extend row without prefix")
    p.add_argument("--calls", type=int, default=20, help="calls per timed round (extend: a quarter)")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds per kernel")
    p.add_argument("--layers", type=int, default=LAYERS, help="layers of int8 weights in the GEMM rows")
    p.add_argument("--vnni-rows", default=None,
                   help="rows of the VNNI GEMM rows, comma-separated (default 1,8,<batch>,256)")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run_cli)
    return p
