"""``radixray bench offline``: in-process decode and prefill speed against the machine's roofline.

Decode at batch B: B requests with ``--context-len`` random prompt tokens
decode ``--decode-steps`` tokens together (greedy, ignore_eos); the step time is
the span from the last first token to the last finish, divided by the steps. The engine
runs without mixed chunks (``enable_mixed_chunk`` off, whatever the flags say): with them,
requests prefilled early would decode while later ones prefill, finish before the others,
and leave the measured span to steps of fewer than B requests.
Prefill: ``--prefill-prompts`` prompts of ``--prefill-len`` tokens, timed to
their first tokens. Bandwidth and GEMM rate are measured in the same run.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
from tqdm import tqdm

from radixray.bench import random_token_prompts, save_json
from radixray.bench.roofline import ModelCost, measure_gemm_flops, measure_read_bandwidth
from radixray.common.passing_thread import in_passing_thread

logger = logging.getLogger(__name__)


def decode_step_seconds(engine, batch: int, ctx: int, steps: int, seed: int) -> float:
    """Seconds per decode step of ``batch`` requests at ``ctx`` tokens of context; the engine
    must run without mixed chunks (:func:`offline_engine_options`), so that all ``batch``
    prefill before any decodes and each of the ``steps`` steps carries all of them."""
    prompts = random_token_prompts(batch, ctx, engine.limits.vocab_size, seed)
    params = {"temperature": 0.0, "max_new_tokens": steps + 1, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    first = max(o["meta_info"]["first_token_latency"] for o in outs)
    last = max(o["meta_info"]["e2e_latency"] for o in outs)
    engine.flush_cache()
    return (last - first) / steps


def prefill_tokens_per_second(engine, n: int, length: int, seed: int) -> float:
    prompts = random_token_prompts(n, length, engine.limits.vocab_size, seed)
    t0 = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1, "temperature": 0.0})
    seconds = time.perf_counter() - t0
    engine.flush_cache()
    return n * length / seconds


# torch.profiler's names for a call into torch.compile'd code: the frame, or (torch >= 2.6) the
# inductor graph it runs
COMPILED_REGIONS = ("Torch-Compiled Region", "## Call CompiledFxGraph")


def python_overhead(engine, batch: int, ctx: int, steps: int = 8) -> dict:
    """Per decode step under torch.profiler: wall time, time inside top-level ops (aten and
    ours, or the torch.compile region that calls them), the rest.

    The rest is Python, dispatch and scheduling work between ops; the profiler
    adds a few microseconds per op to it, so it is an upper bound.
    """
    from torch.profiler import ProfilerActivity, profile
    prompts = random_token_prompts(batch, ctx, engine.limits.vocab_size, 99)
    params = {"temperature": 0.0, "max_new_tokens": steps + 1, "ignore_eos": True}
    prof = profile(activities=[ProfilerActivity.CPU])
    with engine.profiling(prof):  # on the scheduler thread, where the steps run
        engine.generate(input_ids=prompts, sampling_params=params)
    engine.flush_cache()
    return {"batch": batch, **step_breakdown(prof.events())}


def step_breakdown(events, step_name: str = "decode_step") -> dict:
    """Mean per ``step_name`` event of a torch.profiler trace: its wall time (``step_ms``), the
    time inside its top-level ops and compiled regions (``aten_ms``), the rest (``other_ms``)
    and the ops it ran (``ops_per_step``: a compiled region counts the ops it calls)."""
    steps = [e for e in events if e.name == step_name]
    if not steps:
        raise ValueError(f"the trace has no {step_name!r} event")
    wall = sum(e.cpu_time_total for e in steps) / 1000 / len(steps)
    top = [c for e in steps for c in e.cpu_children
           if "::" in c.name or c.name.startswith(COMPILED_REGIONS)]
    in_ops = sum(c.cpu_time_total for c in top) / 1000 / len(steps)
    ops = [o for c in top for o in _outermost_ops(c)]
    return {"step_ms": wall, "aten_ms": in_ops, "other_ms": wall - in_ops,
            "ops_per_step": len(ops) / len(steps)}


def _outermost_ops(event) -> list:
    """The first ops (``ns::name``) on each path down from ``event``: the event itself, or
    those a compiled region calls."""
    if "::" in event.name:
        return [event]
    return [o for child in event.cpu_children for o in _outermost_ops(child)]


def offline_engine_options(engine_options: dict, max_total_tokens: int, max_batch: int) -> dict:
    """The engine this benchmark measures: ``engine_options`` with a pool of
    ``max_total_tokens``, room for ``max_batch`` running requests (or the flags' larger
    limit), and mixed chunks off (see the module docstring; logged unless the flags had
    turned them off already)."""
    if engine_options.get("enable_mixed_chunk", True):
        logger.info("bench offline: enable_mixed_chunk off, so that every measured decode "
                    "step carries the whole batch")
    return {**engine_options, "max_total_tokens": max_total_tokens, "enable_mixed_chunk": False,
            "max_running_requests": max(max_batch, engine_options.get("max_running_requests") or 0)}


def run_offline_bench(args, engine_options: dict) -> dict:
    """``engine_options``: the EngineConfig flags given; the pool and the running-request
    limit default to what the largest batch needs."""
    from radixray import Engine
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    max_batch = max(batch_sizes)
    pool = args.max_total_tokens or max(
        max_batch * (args.context_len + args.decode_steps + 2), args.prefill_prompts * (args.prefill_len + 2)) + 64
    engine = Engine(**offline_engine_options(engine_options, pool, max_batch))
    facts = engine.model_facts()
    cost = ModelCost.of(facts.module, facts.kv_bytes_per_token)
    dtype = facts.dtype
    results: dict = {"model": args.model, "dtype": str(dtype).removeprefix("torch."),
                     "quantization": facts.quantization, "kv_cache_dtype": facts.kv_cache_dtype,
                     "precision": facts.precision,
                     "quantize_lm_head": facts.quantize_lm_head,
                     "threads": torch.get_num_threads(), "context_len": args.context_len,
                     "decode_steps": args.decode_steps, "weight_bytes": cost.weight_bytes}
    try:
        with tqdm(total=3 + len(batch_sizes), desc="bench offline", unit="stage") as bar:
            # off this thread, whose OpenMP team would slow the engine (common/passing_thread.py)
            bw = in_passing_thread(measure_read_bandwidth)
            # int8 layers: the compute ceiling is the int8 GEMM rate (attention stays in dtype)
            gemm = in_passing_thread(measure_gemm_flops,
                                     dtype=torch.int8 if facts.quantization else dtype)
            results.update(bandwidth_gbs=bw / 1e9, gemm_tflops=gemm / 1e12)
            bar.update(1)
            decode_step_seconds(engine, 1, args.context_len, 4, seed=0)  # warm-up
            bar.update(1)
            results["decode"] = []
            for b in batch_sizes:
                reps = [decode_step_seconds(engine, b, args.context_len, args.decode_steps, seed=r + 1)
                        for r in range(args.repeats)]
                step = statistics.median(reps)
                floor = cost.decode_step_floor(b, args.context_len + args.decode_steps // 2, bw, gemm)
                results["decode"].append({
                    "batch": b, "step_ms": step * 1000, "tokens_per_s": b / step,
                    "floor_ms": floor * 1000, "roofline_tokens_per_s": b / floor,
                    "step_over_floor": step / floor, "fraction_of_roofline": floor / step})
                bar.update(1)
            if args.prefill_prompts > 0:  # --prefill-prompts 0: decode steps only
                tps = statistics.median(prefill_tokens_per_second(engine, args.prefill_prompts,
                                                                  args.prefill_len, seed=100 + r)
                                        for r in range(args.repeats))
                pf = cost.prefill_floor(args.prefill_prompts * args.prefill_len, args.prefill_len, gemm)
                roof = args.prefill_prompts * args.prefill_len / pf
                results["prefill"] = {"prompt_len": args.prefill_len, "prompts": args.prefill_prompts,
                                      "tokens_per_s": tps, "roofline_tokens_per_s": roof,
                                      "fraction_of_roofline": tps / roof}
                bar.update(1)
        results["overhead"] = [python_overhead(engine, b, args.context_len)
                               for b in (1, max_batch)]
    finally:
        engine.shutdown()
    print_report(results)
    save_json(results, args.output)
    return results


def print_report(r: dict) -> None:
    quant = r.get("quantization")
    print(f"\nmodel={r['model']} dtype={r['dtype']} quantization={quant} threads={r['threads']} "
          f"weights={r['weight_bytes'] / 1e6:.0f} MB")
    print(f"machine: read bandwidth {r['bandwidth_gbs']:.1f} GB/s, "
          f"{'int8 ' if quant else ''}GEMM {r['gemm_tflops'] * 1000:.0f} G{'OP' if quant else 'FLOP'}/s")
    print(f"{'batch':>5} {'step ms':>9} {'tok/s':>9} {'floor ms':>9} {'roof tok/s':>11} {'step/floor':>10} {'% roof':>7}")
    for d in r["decode"]:
        print(f"{d['batch']:>5} {d['step_ms']:>9.2f} {d['tokens_per_s']:>9.1f} {d['floor_ms']:>9.2f} "
              f"{d['roofline_tokens_per_s']:>11.1f} {d['step_over_floor']:>10.2f} "
              f"{100 * d['fraction_of_roofline']:>6.1f}%")
    p = r.get("prefill")
    if p is not None:
        print(f"prefill {p['prompts']} x {p['prompt_len']} tokens: {p['tokens_per_s']:.0f} tok/s "
              f"(roofline {p['roofline_tokens_per_s']:.0f}, {100 * p['fraction_of_roofline']:.1f}%)")
    for o in r.get("overhead", []):
        print(f"batch {o['batch']} under torch.profiler: step {o['step_ms']:.1f} ms = "
              f"{o['aten_ms']:.1f} ms in {o['ops_per_step']:.0f} ops + {o['other_ms']:.1f} ms "
              "Python/dispatch/scheduling")
