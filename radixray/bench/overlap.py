"""``radixray bench overlap``: decode step time with overlap scheduling off and on.

One engine per mode, the same model and options, the same prompts: a batch of
``--requests`` prompts decodes ``--max-new-tokens`` tokens, and the figure is the mean
decode step: the batch's wall time less that of the same batch stopped at its first token
(the prefill), over the decode steps. The modes alternate
for ``--repeats`` rounds (off, on, off, on, ...) so drift on a shared machine hits both;
medians are reported. With overlap on it also reports the scheduler-thread seconds spent
while a forward pass ran (``hidden_s``, what the pipeline hid) as a share of the decode
time.

    radixray bench overlap --requests 16 --max-new-tokens 64 --repeats 3
"""

from __future__ import annotations

import os
import statistics
import time

from radixray.bench import (
    ENGINE_FLAGS,
    add_engine_arguments,
    random_token_prompts,
    register,
    save_json,
)


def _timed(eng, prompts: list[list[int]], new_tokens: int) -> float:
    eng.flush_cache()
    t0 = time.perf_counter()
    eng.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "ignore_eos": True,
                                                     "max_new_tokens": new_tokens})
    return time.perf_counter() - t0


def _decode_run(eng, prompts: list[list[int]], new_tokens: int) -> dict:
    """One batch to ``new_tokens``, less the same batch to its first token (the prefill):
    the decode steps' wall time, and the scheduler work the pipeline hid meanwhile."""
    prefill_s = _timed(eng, prompts, 1)
    steps0, hidden0 = _decode_counters(eng)
    wall = _timed(eng, prompts, new_tokens)
    steps1, hidden1 = _decode_counters(eng)
    decode_s = max(wall - prefill_s, 1e-9)
    steps = max(steps1 - steps0, 1)
    return {"wall_s": wall, "decode_s": decode_s, "decode_steps": steps,
            "step_ms": 1e3 * decode_s / steps, "hidden_s": hidden1 - hidden0}


def _decode_counters(eng) -> tuple[int, float]:
    """Decode steps so far, and the scheduler seconds the overlap pipeline hid so far."""
    snap = eng.snapshot()
    return snap.decode_steps, snap.overlap["hidden_s"] if snap.overlap is not None else 0.0


def run(args) -> dict:
    from radixray import Engine
    options = {"model": args.model, "dtype": args.dtype, "quantization": args.quantization,
               "quantize_lm_head": args.quantize_lm_head, "kv_cache_dtype": args.kv_cache_dtype,
               "max_total_tokens": args.max_total_tokens}
    engines = {mode: Engine(enable_overlap_schedule=mode == "on", **options)
               for mode in ("off", "on")}
    try:
        vocab = engines["off"].limits.vocab_size
        prompts = random_token_prompts(args.requests, args.prompt_len, vocab, seed=0)
        for eng in engines.values():  # warm-up
            _decode_run(eng, prompts[:2], 4)
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        for _ in range(args.repeats):
            for mode, eng in engines.items():
                runs[mode].append(_decode_run(eng, prompts, args.max_new_tokens))
        overlap = engines["on"].snapshot().overlap
    finally:
        for eng in engines.values():
            eng.shutdown()
    med = {mode: statistics.median(r["step_ms"] for r in rs) for mode, rs in runs.items()}
    hidden_share = statistics.median(r["hidden_s"] / r["decode_s"] for r in runs["on"])
    out = {"requests": args.requests, "prompt_len": args.prompt_len,
           "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
           "options": options, "cpu_count": os.cpu_count(),
           "median_step_ms": med, "on_over_off": med["on"] / med["off"],
           "hidden_share_of_decode": hidden_share, "overlap_stats": overlap, "runs": runs}
    print(f"decode step, median of {args.repeats}: off {med['off']:.2f} ms, on "
          f"{med['on']:.2f} ms ({med['on'] / med['off']:.3f}x); scheduler work hidden under "
          f"the forward: {100 * hidden_share:.1f}% of the decode time")
    save_json(out, args.output)
    return out


def _add_arguments(p) -> None:
    add_engine_arguments(p, ENGINE_FLAGS + ("max_total_tokens",), max_total_tokens=16384)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", default=None, help="write the results as JSON here")


def add_parser(bench_subparsers) -> None:
    register(bench_subparsers, "overlap", "decode step time with overlap scheduling off and on",
             _add_arguments, run)
