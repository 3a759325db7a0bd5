"""``radixray bench kernels``: the C++ CPU kernels against the torch code they replace.

Each row times one kernel and its torch counterpart on the same inputs, turn
about (``--repeats`` rounds of ``--calls`` calls each; medians), at the shapes
of the default model (SmolLM2-135M: 9 query heads, 3 kv heads, head size 64,
MLP width 1,536):

- decode attention, ``--batch`` requests x ``--context-len`` tokens over a paged
  fp32 or bf16 pool, against the torch backend's gather + SDPA; the kernel's
  rate is given as GB/s of pool bytes read;
- extend (prefill) attention, a ``--prefill-len`` prompt with no cached prefix and
  128 new tokens after a 2,048-token prefix, against SDPA with a causal mask;
- the middle of an int8 gated MLP (rescale, SiLU-mul, quantize) fused against the
  three ops one after the other, at prefill (2,048 rows) and decode (``--batch``) sizes;
- the small-M int8 GEMM against ``torch._int_mm`` over one decode step's worth of
  int8 weights (30 layers x qkv, o, gate|up, down: 106 MB, so they come from
  memory) at 1 and 4 rows.

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

from radixray.engine.hugepages import empty_huge

HEADS, KV_HEADS, HEAD_DIM, INTER, HIDDEN, LAYERS = 9, 3, 64, 1536, 576, 30


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


def _decode_row(ext, dtype: torch.dtype, batch: int, ctx: int, calls: int, repeats: int) -> dict:
    slots = batch * ctx + 1
    k_pool, v_pool = (empty_huge((slots, KV_HEADS, HEAD_DIM), dtype) for _ in range(2))
    k_pool.copy_(torch.randn(k_pool.shape)), v_pool.copy_(torch.randn(v_pool.shape))
    q = torch.randn(batch, HEADS, HEAD_DIM)
    idx = torch.arange(1, slots).view(batch, ctx)
    lens = torch.full((batch,), ctx)
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


def _int8_gemm_row(ext, m: int, weights: list[torch.Tensor], calls: int, repeats: int) -> dict:
    xs = {k: torch.randint(-127, 128, (m, k), dtype=torch.int8) for k in (HIDDEN, INTER)}
    transposed = [w.t() for w in weights]  # the layout Int8Linear hands torch._int_mm

    def kernel():
        return [ext.int8_gemm_small_m(xs[w.shape[1]], w) for w in weights]

    def onednn():
        return [torch._int_mm(xs[w.shape[0]], w) for w in transposed]

    assert all(torch.equal(a, b) for a, b in zip(kernel(), onednn()))
    fast, slow = _paired_medians(kernel, onednn, calls, repeats)
    total = sum(w.numel() for w in weights)
    return {"kernel": "int8 GEMM (step)", "shape": f"{m} rows x {len(weights)} weights",
            "cpp_ms": fast, "torch_ms": slow, "rate": f"{total / fast / 1e6:.1f} GB/s"}


def run_cli(args: argparse.Namespace) -> int:
    from radixray.kernels.cpu_ops import load_extension
    ext = load_extension()
    if ext is None:
        print("the C++ CPU kernels are not available on this machine (see the log); nothing to compare")
        return 1
    rows = [_decode_row(ext, dtype, args.batch, args.context_len, args.calls, args.repeats)
            for dtype in (torch.float32, torch.bfloat16)]
    rows += [_extend_row(ext, n, plen, max(1, args.calls // 4), args.repeats)
             for n, plen in ((args.prefill_len, 0), (128, 2048))]
    rows += [_mlp_row(ext, m, args.calls, args.repeats) for m in (2048, args.batch)]
    shapes = [(HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HEADS * HEAD_DIM),
              (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    weights = [torch.randint(-127, 128, s, dtype=torch.int8) for _ in range(args.layers) for s in shapes]
    rows += [_int8_gemm_row(ext, m, weights, max(1, args.calls // 10), args.repeats) for m in (1, 4)]
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
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run_cli)
    return p
