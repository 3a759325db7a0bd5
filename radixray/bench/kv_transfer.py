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
sender writes each rank's heads out of its whole rows, re-sliced as the prefill worker's
sender does (a decode rank's row is a piece of ours: staged in chunks, then whole-row runs,
engine/disaggregation/staging.py), against plain whole-row runs at ``--decode-tp-size 1``.
``--no-staging`` writes the pieces as one span per slot, layer and buffer instead (the
fallback where no stager is given). The ranks' pools live in one receiving process here
(one transfer session); in a fleet each rank has its own. The sender (one rank) cannot
express the other direction (a decode rank holding more heads than one prefill rank).
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


class _Counting:
    """A transport that counts the spans written through it."""

    def __init__(self, transport):
        self.transport, self.spans = transport, 0

    def write(self, session, src, dst, lengths) -> None:
        self.spans += len(lengths)
        self.transport.write(session, src, dst, lengths)

    def __getattr__(self, name):
        return getattr(self.transport, name)


def run(model: str, tokens: int, repeats: int, loopback_chunk: int = 64 << 20,
        decode_tp_size: int = 1, staging: bool = True) -> dict:
    """Write ``tokens`` slots' KV ``repeats`` times; ``spans``: what one write issued,
    ``staged``: whether any piece went through the stager (``staging`` False: none)."""
    from radixray.bench.loopback import tcp_loopback_rate
    from radixray.engine.disaggregation.layout import pool_layout, rank_spans
    from radixray.engine.disaggregation.messages import KVEndpoint
    from radixray.engine.disaggregation.mooncake import MooncakeTransport
    from radixray.engine.disaggregation.sender import write_share
    from radixray.engine.disaggregation.staging import SliceStager
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
    transport = _Counting(MooncakeTransport())
    stager = None
    try:
        bufs = _pool(*shape, fill=True)
        for b in bufs:
            transport.register(b.data_ptr(), b.numel() * b.element_size())
        layers = shape[0]
        local = KVEndpoint(("",), (pool_layout(bufs[:layers], bufs[layers:]),))
        if staging:
            stager = SliceStager(transport, bufs[:layers], bufs[layers:])
        slots = torch.arange(1, tokens + 1)
        unstaged = sum(len(w[3]) for w in rank_spans(local, 0, slots, remote, slots))
        write_share(transport, local, 0, slots[:1], remote, slots[:1], stager)  # handshake
        rates, plan_s, stage_s = [], [], []
        for _ in range(repeats):
            transport.spans, staged_before = 0, stager.stage_seconds if stager else 0.0
            t0 = time.perf_counter()
            written = write_share(transport, local, 0, slots, remote, slots, stager)
            rates.append(written / (time.perf_counter() - t0))
            if stager is not None:
                stage_s.append(stager.stage_seconds - staged_before)
            t1 = time.perf_counter()
            rank_spans(local, 0, slots, remote, slots)  # the unstaged span planning alone
            plan_s.append(time.perf_counter() - t1)
    finally:  # the receiver waits for this, also when a write failed
        done.put(1)
        child.join(60)
        if child.is_alive():
            child.kill()
        if stager is not None:
            stager.close()
        transport.close()
    loop_after = tcp_loopback_rate(loopback_chunk)
    loopback = max(loop_before, loop_after)
    rate = statistics.median(rates)
    staged = stager is not None and stager.spans > 0
    return {"model": model, "tokens": tokens, "bytes": written, "spans": transport.spans,
            "staged": staged, "unstaged_spans": unstaged,
            "stage_s_median": statistics.median(stage_s) if staged else 0.0,
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
    p.add_argument("--no-staging", dest="staging", action="store_false",
                   help="re-sliced rows as one span per slot, layer and buffer (no stager)")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from radixray.bench import save_json
    out = run(args.model, args.tokens, args.repeats, decode_tp_size=args.decode_tp_size,
              staging=args.staging)
    how = (f"staged in {out['stage_s_median'] * 1e3:.1f} ms" if out["staged"] else
           f"planned in {out['plan_s_median'] * 1e3:.1f} ms")
    print(f"KV of {out['tokens']} tokens into {out['decode_tp_size']} decode rank(s) "
          f"({out['bytes'] / 1e6:.1f} MB in {out['spans']} spans, {how}): "
          f"median {out['kv_gb_s_median']:.2f} GB/s over {out['repeats']} writes; loopback TCP "
          f"{out['loopback_gb_s'][0]:.2f} / {out['loopback_gb_s'][1]:.2f} GB/s (before / after); "
          f"ratio to the higher {out['kv_vs_loopback']:.2f}")
    save_json(out, args.output_json)
    return 0
