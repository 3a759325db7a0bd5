"""``radixray bench mixed-chunk``: inter-token latency with and without ``enable_mixed_chunk``.

In-process (no HTTP): ``--concurrency`` streams (``Engine.generate_stream``, each sending its
next prompt when its last one finished, as ``bench serve --max-concurrency`` does) over
``--num-prompts`` random prompts of ``--input-len`` tokens, ``--output-len`` tokens each
(ignore_eos). For each ``--chunk-sizes`` value the engine runs with mixing off and on, one
after the other, ``--repeats`` times (on: steps with riders sized by ``--max-itl-ms``; 0 gives
the fixed chunk); one engine for all runs (its chunk size and mixing
are set between runs, with the prefix cache flushed). Reported per run, with the
serving benchmark's definitions (serve_metrics.py): max and p99 ITL (a gap between two
streamed chunks of one request), p50 TTFT, output tok/s; and the median over repeats.

    radixray bench mixed-chunk --quantization w8a8_int8 --quantize-lm-head \\
        --kv-cache-dtype fp8_e5m2 --chunk-sizes 2048,256
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time

from radixray.bench import (
    ENGINE_FLAGS,
    add_engine_arguments,
    random_token_prompts,
    register,
    save_json,
    standalone_main,
    workload_header,
)
from radixray.bench.serve_metrics import RequestRecord, summarize

logger = logging.getLogger(__name__)

REPORTED = ("max_itl_ms", "p99_itl_ms", "median_itl_ms", "median_ttft_ms", "output_throughput",
            "duration_s")


async def _stream_all(engine, prompts: list[list[int]], output_len: int,
                      concurrency: int) -> tuple[list[RequestRecord], float]:
    """Every prompt streamed with ``concurrency`` in flight; records and the run's seconds."""
    params = {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}
    todo = list(enumerate(prompts))
    records: list[RequestRecord] = []

    async def client() -> None:
        while todo:
            i, p = todo.pop(0)
            rec = RequestRecord(index=i, concurrency=concurrency, prompt_tokens=len(p))
            sent = last = time.perf_counter()
            async for chunk in engine.generate_stream(input_ids=p, sampling_params=params):
                now = time.perf_counter()
                if chunk["output_ids"]:
                    if rec.ttft is None:
                        rec.ttft = now - sent
                    else:
                        rec.itl.append(now - last)
                    last = now
                    rec.output_tokens += len(chunk["output_ids"])
            rec.latency = time.perf_counter() - sent
            rec.success = rec.output_tokens == output_len
            records.append(rec)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return records, time.perf_counter() - t0


def set_mode(engine, chunk_size: int, mixed: bool, max_itl_ms: float | None) -> None:
    """Between runs, on the scheduler thread: this chunk size, mixing and ITL target, an empty
    prefix cache (the same prompts run again) and fresh counters. One engine serves every run,
    so model loading (a minute for int8 on a busy 2-vCPU host) is paid once."""
    engine.retune_prefill(chunk_size, mixed, max_itl_ms)
    assert engine.flush_cache(), "the prefix cache could not be flushed between runs"


def run_once(engine, args, prompts: list[list[int]], chunk_size: int, mixed: bool) -> dict:
    """One run of the workload at ``chunk_size`` with mixing ``mixed``: its summary."""
    set_mode(engine, chunk_size, mixed, args.max_itl_ms)
    records, seconds = asyncio.run(_stream_all(engine, prompts, args.output_len,
                                               args.concurrency))
    stats = engine.snapshot()
    summary = summarize(records, seconds, label=f"chunk {chunk_size} mixed {mixed}",
                        max_concurrency=args.concurrency)
    summary.update(chunk_size=chunk_size, mixed=mixed, mixed_forwards=stats.mixed_forwards,
                   forward_steps=stats.forward_steps)
    print(f"chunk {chunk_size:>5} mixed {'on ' if mixed else 'off'}: max ITL "
          f"{summary['max_itl_ms']:8.0f} ms, p99 ITL {summary['p99_itl_ms']:7.0f} ms, p50 TTFT "
          f"{summary['median_ttft_ms']:7.0f} ms, {summary['output_throughput']:6.1f} out tok/s, "
          f"{summary['duration_s']:5.1f} s, forwards {stats.forward_steps} (mixed "
          f"{stats.mixed_forwards})", flush=True)
    return summary


def run(args) -> dict:
    import torch

    from radixray import Engine
    chunk_sizes = [int(c) for c in str(args.chunk_sizes).split(",")]
    results: dict = {"model": args.model, "quantization": args.quantization,
                     "quantize_lm_head": args.quantize_lm_head,
                     "kv_cache_dtype": args.kv_cache_dtype, "dtype": args.dtype,
                     "threads": torch.get_num_threads(), "input_len": args.input_len,
                     "output_len": args.output_len, "num_prompts": args.num_prompts,
                     "concurrency": args.concurrency, "itl_target_ms": args.max_itl_ms,
                     "runs": [], "medians": []}
    pool = args.concurrency * (args.input_len + args.output_len + 8) + 256
    with Engine(model=args.model, dtype=args.dtype, quantization=args.quantization,
                quantize_lm_head=args.quantize_lm_head, kv_cache_dtype=args.kv_cache_dtype,
                max_total_tokens=pool, max_running_requests=args.concurrency) as engine:
        prompts = random_token_prompts(args.num_prompts, args.input_len,
                                       engine.limits.vocab_size, args.seed)
        engine.generate(input_ids=prompts[0][:16], sampling_params={"max_new_tokens": 4})
        for _ in range(args.repeats):
            for chunk in chunk_sizes:
                for mixed in (False, True):
                    results["runs"].append(run_once(engine, args, prompts, chunk, mixed))
                    save_json(results, args.output)
    for chunk in chunk_sizes:
        for mixed in (False, True):
            runs = [r for r in results["runs"] if r["chunk_size"] == chunk and r["mixed"] == mixed]
            results["medians"].append({"chunk_size": chunk, "mixed": mixed, "repeats": len(runs),
                                       **{k: statistics.median(r[k] for r in runs)
                                          for k in REPORTED}})
    print_report(results)
    save_json(results, args.output)
    return results


def print_report(r: dict) -> None:
    print(f"\n{workload_header(r)} at concurrency {r['concurrency']}; "
          f"medians of {r['medians'][0]['repeats']} run(s); mixed steps sized by max_itl_ms="
          f"{r['itl_target_ms']} (0 or None: fixed chunks)")
    print(f"{'chunk':>6} {'mixed':>5} {'max ITL ms':>10} {'p99 ITL ms':>10} {'p50 ITL ms':>10} "
          f"{'p50 TTFT ms':>11} {'out tok/s':>9}")
    for m in r["medians"]:
        print(f"{m['chunk_size']:>6} {'on' if m['mixed'] else 'off':>5} {m['max_itl_ms']:>10.0f} "
              f"{m['p99_itl_ms']:>10.0f} {m['median_itl_ms']:>10.1f} {m['median_ttft_ms']:>11.0f} "
              f"{m['output_throughput']:>9.1f}")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p, ENGINE_FLAGS + ("max_itl_ms",))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--chunk-sizes", default="2048",
                   help="comma-separated chunked_prefill_size values, each run off and on")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write results as JSON here")


def add_parser(bench_subparsers) -> None:
    """Register ``mixed-chunk`` on the ``radixray bench`` subparsers."""
    register(bench_subparsers, "mixed-chunk", "in-process: max and p99 inter-token latency with and "
             "without enable_mixed_chunk", _add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    return standalone_main(argv, "mixed_chunk", __doc__, _add_arguments, run, "WARNING")


if __name__ == "__main__":
    raise SystemExit(main())
