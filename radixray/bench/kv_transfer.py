"""``radixray bench kv-transfer``: the KV transport against plain loopback TCP, side by side.

Two processes, as a prefill and a decode worker: the receiver allocates a KV pool shaped
like the model's (per layer, key and value buffers of ``[slots, kv_heads, head_dim]``),
faults it in and registers it; the sender writes one prompt's KV into it with the same
spans the prefill worker's sender builds (one per layer and key/value for contiguous
slots), ``--repeats`` times. Plain sockets between two processes give the ceiling, measured
in the same invocation before and after. Nothing else runs, so this is the transport's
own rate; ``bench serve --dataset interference --loopback-tcp`` gives the rate while both
roles compute.
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


def _receiver(shape, ready, done) -> None:
    from radixray.engine.disaggregation.layout import pool_layout
    from radixray.engine.disaggregation.mooncake import MooncakeTransport
    layers, slots, heads, dim, dtype = shape
    transport = MooncakeTransport()
    bufs = _pool(layers, slots, heads, dim, dtype, fill=False)
    for b in bufs:
        transport.register(b.data_ptr(), b.numel() * b.element_size())
    ready.put((transport.session, pool_layout(bufs[:layers], bufs[layers:])))
    done.get()


def run(model: str, tokens: int, repeats: int, loopback_chunk: int = 64 << 20) -> dict:
    from radixray.bench.loopback import tcp_loopback_rate
    from radixray.engine.disaggregation.layout import copy_spans, pool_layout
    from radixray.engine.disaggregation.mooncake import MooncakeTransport
    from radixray.engine.executor.model_runner import head_dim_of
    from radixray.engine.weights.loader import resolve_model
    hf = resolve_model(model).config
    shape = (hf.num_hidden_layers, tokens + 1, hf.num_key_value_heads, head_dim_of(hf),
             torch.float32)
    loop_before = tcp_loopback_rate(loopback_chunk)
    ctx = mp.get_context("spawn")
    ready, done = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_receiver, args=(shape, ready, done))
    child.start()
    session, remote = ready.get(timeout=120)
    transport = MooncakeTransport()
    bufs = _pool(*shape, fill=True)
    for b in bufs:
        transport.register(b.data_ptr(), b.numel() * b.element_size())
    layers = shape[0]
    local = pool_layout(bufs[:layers], bufs[layers:])
    slots = torch.arange(1, tokens + 1)
    src, dst, lengths = copy_spans(local, slots, remote, slots)
    transport.write(session, *copy_spans(local, slots[:1], remote, slots[:1]))  # handshake
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        transport.write(session, src, dst, lengths)
        rates.append(sum(lengths) / (time.perf_counter() - t0))
    done.put(1)
    child.join(60)
    transport.close()
    loop_after = tcp_loopback_rate(loopback_chunk)
    loopback = max(loop_before, loop_after)
    rate = statistics.median(rates)
    return {"model": model, "tokens": tokens, "bytes": sum(lengths), "spans": len(lengths),
            "repeats": repeats, "kv_gb_s_median": rate / 1e9,
            "kv_gb_s_all": [r / 1e9 for r in rates],
            "loopback_gb_s": [loop_before / 1e9, loop_after / 1e9],
            "kv_vs_loopback": rate / loopback}


def add_parser(sub) -> None:
    p = sub.add_parser("kv-transfer", help="the KV transport (Mooncake TCP) vs loopback TCP")
    add_engine_arguments(p, ("model",))  # the KV shape of this model
    p.add_argument("--tokens", type=int, default=2048, help="prompt tokens per write")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from radixray.bench import save_json
    out = run(args.model, args.tokens, args.repeats)
    print(f"KV of {out['tokens']} tokens ({out['bytes'] / 1e6:.1f} MB in {out['spans']} spans): "
          f"median {out['kv_gb_s_median']:.2f} GB/s over {out['repeats']} writes; loopback TCP "
          f"{out['loopback_gb_s'][0]:.2f} / {out['loopback_gb_s'][1]:.2f} GB/s (before / after); "
          f"ratio to the higher {out['kv_vs_loopback']:.2f}")
    save_json(out, args.output_json)
    return 0
