"""``radixray bench kv-transfer``: the KV transport against plain loopback TCP, side by side.

Two processes, as a prefill and a decode worker: the receiver allocates a KV pool shaped
like the model's (per layer, key and value buffers of ``[slots, kv_heads, head_dim]``),
faults it in and registers it; the sender writes one prompt's KV into it with the same
spans the prefill worker's sender builds (one per layer and key/value for contiguous
slots), ``--repeats`` times. Plain sockets between two processes give the ceiling, measured
in the same invocation before and after. Nothing else runs, so this is the transport's
own rate; ``bench serve --dataset interference --loopback-tcp`` gives the rate while both
roles compute.

``--decode-tp-size N`` shapes the receiver as a tensor-parallel decode worker of N ranks
(one pool per rank, holding that rank's KV heads) fed by a prefill worker of one rank: the
sender writes each rank's heads out of its whole rows (re-sliced: one span per slot, layer
and buffer, as engine/disaggregation/layout.py plans them), against whole-row runs at
``--decode-tp-size 1``. The ranks' pools live in one receiving process here (one transfer
session); in a fleet each rank has its own.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

from radixray.bench import add_engine_arguments


def _pool(layers: int, slots: int, heads: int, dim: int, dtype: torch.dtype, fill: bool):
    from radixray.engine.mem_cache.hugepages import empty_huge, populate_rows
    bufs = [empty_huge((slots, heads, dim), dtype) for _ in range(2 * layers)]
    if fill:
        for b in bufs:
            b.normal_()
    else:
        populate_rows(bufs, 4096)
    return bufs


def _receiver(shape, tp_size, hf_config, ready, done) -> None:
    from radixray.engine.disaggregation.layout import pool_layout
    from radixray.engine.disaggregation.messages import KVEndpoint
    from radixray.engine.disaggregation.mooncake import MooncakeTransport
    from radixray.engine.tp.sharding import TPShard
    layers, slots, _, dim, dtype = shape
    transport = MooncakeTransport()
    layouts, pools = [], []
    for rank in range(tp_size):
        shard = TPShard.of(hf_config, rank, tp_size)
        bufs = _pool(layers, slots, shard.local_kv_heads, dim, dtype, fill=False)
        for b in bufs:
            transport.register(b.data_ptr(), b.numel() * b.element_size())
        start = shard.kv_head_start if tp_size > 1 else 0
        layouts.append(pool_layout(bufs[:layers], bufs[layers:],
                                   tuple(range(start, start + shard.local_kv_heads))))
        pools.append(bufs)
    ready.put(KVEndpoint((transport.session,) * tp_size, tuple(layouts)))
    done.get()


def run(model: str, tokens: int, repeats: int, loopback_chunk: int = 64 << 20,
        decode_tp_size: int = 1) -> dict:
    from radixray.bench.loopback import tcp_loopback_rate
    from radixray.engine.disaggregation.layout import pool_layout, rank_spans
    from radixray.engine.disaggregation.messages import KVEndpoint
    from radixray.engine.disaggregation.mooncake import MooncakeTransport
    from radixray.engine.disaggregation.sender import write_share
    from radixray.engine.executor.model_runner import head_dim_of
    from radixray.engine.tp.sharding import check_tp_size
    from radixray.engine.weights.loader import resolve_model
    hf = resolve_model(model).config
    check_tp_size(hf, decode_tp_size)
    shape = (hf.num_hidden_layers, tokens + 1, hf.num_key_value_heads, head_dim_of(hf),
             torch.float32)
    loop_before = tcp_loopback_rate(loopback_chunk)
    ctx = mp.get_context("spawn")
    ready, done = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_receiver, args=(shape, decode_tp_size, hf, ready, done))
    child.start()
    remote = ready.get(timeout=120)
    transport = MooncakeTransport()
    try:
        bufs = _pool(*shape, fill=True)
        for b in bufs:
            transport.register(b.data_ptr(), b.numel() * b.element_size())
        layers = shape[0]
        local = KVEndpoint(("",), (pool_layout(bufs[:layers], bufs[layers:]),))
        slots = torch.arange(1, tokens + 1)
        spans = sum(len(w[3]) for w in rank_spans(local, 0, slots, remote, slots))
        write_share(transport, local, 0, slots[:1], remote, slots[:1])  # handshake
        rates, plan_s = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            written = write_share(transport, local, 0, slots, remote, slots)
            rates.append(written / (time.perf_counter() - t0))
            t1 = time.perf_counter()
            rank_spans(local, 0, slots, remote, slots)  # the span planning alone
            plan_s.append(time.perf_counter() - t1)
    finally:  # the receiver waits for this, also when a write failed
        done.put(1)
        child.join(60)
        if child.is_alive():
            child.kill()
        transport.close()
    loop_after = tcp_loopback_rate(loopback_chunk)
    loopback = max(loop_before, loop_after)
    rate = statistics.median(rates)
    return {"model": model, "tokens": tokens, "bytes": written, "spans": spans,
            "decode_tp_size": decode_tp_size, "plan_s_median": statistics.median(plan_s),
            "repeats": repeats, "kv_gb_s_median": rate / 1e9,
            "kv_gb_s_all": [r / 1e9 for r in rates],
            "loopback_gb_s": [loop_before / 1e9, loop_after / 1e9],
            "kv_vs_loopback": rate / loopback}


def add_parser(sub) -> None:
    p = sub.add_parser("kv-transfer", help="the KV transport (Mooncake TCP) vs loopback TCP")
    add_engine_arguments(p, ("model",))  # the KV shape of this model
    p.add_argument("--tokens", type=int, default=2048, help="prompt tokens per write")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--decode-tp-size", type=int, default=1,
                   help="the receiver as a decode worker of this many tensor-parallel ranks "
                        "(each rank's KV heads re-sliced out of the sender's rows)")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from radixray.bench import save_json
    out = run(args.model, args.tokens, args.repeats, decode_tp_size=args.decode_tp_size)
    print(f"KV of {out['tokens']} tokens into {out['decode_tp_size']} decode rank(s) "
          f"({out['bytes'] / 1e6:.1f} MB in {out['spans']} spans, planned in "
          f"{out['plan_s_median'] * 1e3:.1f} ms): "
          f"median {out['kv_gb_s_median']:.2f} GB/s over {out['repeats']} writes; loopback TCP "
          f"{out['loopback_gb_s'][0]:.2f} / {out['loopback_gb_s'][1]:.2f} GB/s (before / after); "
          f"ratio to the higher {out['kv_vs_loopback']:.2f}")
    save_json(out, args.output_json)
    return 0
