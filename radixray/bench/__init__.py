"""Benchmarks: offline engine throughput, the serving client (bench serve, cache-experiment), the naive baseline server."""


def save_json(results, path: str | None) -> None:
    """Write a benchmark's results to ``path`` as indented JSON; nothing when ``path`` is None."""
    if path:
        import json
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


def json_safe(obj):
    """``obj`` with non-finite floats as strings ("inf"), so the JSON is standard."""
    import math
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_safe(v) for v in obj]
    return obj


def random_token_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of exactly ``length`` token ids drawn from [100, vocab) (past the
    special tokens), reproducible from ``seed``."""
    import random
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def workload_header(r: dict) -> str:
    """The opening of an in-process benchmark's report from its result ``r`` (keys model,
    quantization, kv_cache_dtype, threads, num_prompts, input_len, output_len)."""
    return (f"model={r['model']} quantization={r['quantization']} kv_cache_dtype="
            f"{r['kv_cache_dtype']} threads={r['threads']}: {r['num_prompts']} prompts x "
            f"{r['input_len']} in / {r['output_len']} out")


ENGINE_FLAGS = ("model", "dtype", "quantization", "quantize_lm_head", "kv_cache_dtype")


def add_engine_arguments(p, names: tuple[str, ...] = ENGINE_FLAGS, **defaults) -> None:
    """Engine options ``names`` as flags of an in-process benchmark, with the type, choices,
    default and help of their declaration in EngineConfig; ``defaults`` sets a default of
    this benchmark's own (a smaller KV pool, say)."""
    from radixray.engine import options
    from radixray.engine.config import EngineConfig
    options.add_flags(p, EngineConfig, with_defaults=True, only=names)
    p.set_defaults(**defaults)


def register(bench_subparsers, name: str, help: str, add_arguments, run) -> None:
    """``radixray bench <name>``: ``add_arguments(parser)``, then ``run(args)``, exit 0."""
    p = bench_subparsers.add_parser(name, help=help)
    add_arguments(p)
    p.set_defaults(func=lambda args: (run(args), 0)[1])


def standalone_main(argv, module: str, doc: str, add_arguments, run, log_level: str) -> int:
    """``python -m radixray.bench.<module>``: the same without the rest of the CLI's imports."""
    import argparse
    import logging
    p = argparse.ArgumentParser(prog=f"radixray.bench.{module}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    logging.basicConfig(level=log_level, format="[%(asctime)s] %(message)s")
    run(p.parse_args(argv))
    return 0


# ---- the parallelism benchmarks (bench ep, bench tp): N ranks against one -----------------
def median_run(run_once, repeats: int) -> dict:
    """The median (by tokens_per_s) of ``repeats`` results of ``run_once()``, with every
    run's rate in ``tokens_per_s_runs``."""
    runs = [run_once() for _ in range(repeats)]
    best = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
    best["tokens_per_s_runs"] = [round(r["tokens_per_s"], 1) for r in runs]
    return best


def print_comm_table(rows: list[dict], label: str, size_key: str) -> None:
    """One line per group size: tok/s, forward seconds, collective seconds and share, bytes
    per token per layer."""
    print(f"{label:>3} {'tok/s':>8} {'fwd s':>7} {'comm s':>7} {'comm %':>7} {'B/tok/layer':>12}")
    for r in rows:
        print(f"{r[size_key]:>3} {r['tokens_per_s']:>8.1f} {r['forward_s']:>7.2f} "
              f"{r['comm_s']:>7.2f} {100 * r['comm_share_of_forward']:>6.1f}% "
              f"{r['bytes_per_token_per_layer']:>12.0f}")


def add_group_arguments(p, sizes_flag: str, default_sizes: list[int]) -> None:
    """The workload and repeat flags both parallelism benchmarks take."""
    p.add_argument(sizes_flag, default=default_sizes,
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    add_engine_arguments(p, ("max_total_tokens",), max_total_tokens=8192)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", default=None, help="write the results as JSON here")


def report_group(rows: list[dict], args, label: str, size_key: str, model: str, facts: dict,
                 formula_line: str) -> dict:
    """A parallelism benchmark's result: the workload, ``facts`` (its formula), the TP/EP N
    over 1 rate ratio and ``rows``; printed as a table and the formula line, saved to
    ``args.output``."""
    import os
    out = {"model": model, "requests": args.requests, "prompt_len": args.prompt_len,
           "max_new_tokens": args.max_new_tokens, "threads_per_rank": args.threads,
           "cpu_count": os.cpu_count(), **facts,
           "median_tokens_per_s_ratio": rows[-1]["tokens_per_s"] / rows[0]["tokens_per_s"],
           "results": rows}
    print_comm_table(rows, label, size_key)
    print(f"{formula_line}; each row the median of {args.repeats} runs")
    save_json(out, args.output)
    return out
