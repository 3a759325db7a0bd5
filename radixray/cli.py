"""The ``radixray`` command: serve (HTTP on Ray Serve), generate (offline, in-process) and bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _engine_args(p: argparse.ArgumentParser) -> None:
    """Every EngineConfig option as a flag, with its default (see engine/options.py)."""
    from radixray.engine import options
    from radixray.engine.config import EngineConfig
    options.add_flags(p, EngineConfig, with_defaults=True)
    p.add_argument("--log-level", default="info")


def _engine_options(args) -> dict:
    from radixray.engine import options
    from radixray.engine.config import EngineConfig
    return options.from_flags(args, EngineConfig)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="[%(asctime)s] %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S")


def cmd_generate(args) -> int:
    from radixray import Engine
    with Engine(**_engine_options(args)) as engine:
        params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
        if args.chat:
            ids = engine.apply_chat_template([{"role": "user", "content": args.chat}])
            out = engine.generate(input_ids=ids, sampling_params=params)
        else:
            out = engine.generate(args.prompt, params)
    print(out["text"])
    print(json.dumps(out["meta_info"], indent=2), file=sys.stderr)
    return 0


def cmd_bench_offline(args) -> int:
    from radixray.bench.offline import run_offline_bench
    run_offline_bench(args, _engine_options(args))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixray", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from radixray.serve import serve_cli
    serve_cli.add_parser(sub)

    gen = sub.add_parser("generate", help="run one prompt in-process and print the answer")
    _engine_args(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw text prompt")
    src.add_argument("--chat", help="a user message, formatted with the model's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.set_defaults(func=cmd_generate)

    from radixray.serve import drain_cli
    drain_cli.add_parser(sub)

    rl = sub.add_parser("rl", help="RL jobs on the fleet")
    rl_sub = rl.add_subparsers(dest="rl_command", required=True)
    grpo = rl_sub.add_parser("grpo", help="a GRPO training job (rollout -> reward -> train -> "
                             "weight sync each step)")
    from radixray.rl import grpo as grpo_job
    grpo_job.add_arguments(grpo)
    grpo.set_defaults(func=grpo_job.run_cli)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    off = bench_sub.add_parser("offline", help="decode/prefill throughput and roofline ratios")
    _engine_args(off)
    off.add_argument("--batch-sizes", default="1,8,32,64")
    off.add_argument("--decode-steps", type=int, default=32)
    off.add_argument("--context-len", type=int, default=128, help="prompt tokens per decode request")
    off.add_argument("--prefill-len", type=int, default=512)
    off.add_argument("--prefill-prompts", type=int, default=4)
    off.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is reported")
    off.add_argument("--output", default=None, help="write results as JSON here")
    off.set_defaults(func=cmd_bench_offline)
    from radixray.bench import (
        autoscale,
        cache_experiment,
        compare,
        default_quality,
        expert_parallel,
        hicache,
        kernels,
        kv_transfer,
        lora,
        mixed_chunk,
        naive_server,
        overlap,
        quant_quality,
        rl_async,
        serve_client,
        speculative,
        tensor_parallel,
        vs_hf,
        weight_update,
    )
    serve_client.add_parser(bench_sub)
    compare.add_parser(bench_sub)
    autoscale.add_parser(bench_sub)
    kernels.add_parser(bench_sub)
    kv_transfer.add_parser(bench_sub)
    cache_experiment.add_parser(bench_sub)
    naive_server.add_parser(bench_sub)
    quant_quality.add_parser(bench_sub)
    default_quality.add_parser(bench_sub)
    overlap.add_parser(bench_sub)
    vs_hf.add_parser(bench_sub)
    weight_update.add_parser(bench_sub)
    expert_parallel.add_parser(bench_sub)
    hicache.add_parser(bench_sub)
    speculative.add_parser(bench_sub)
    mixed_chunk.add_parser(bench_sub)
    tensor_parallel.add_parser(bench_sub)
    rl_async.add_parser(bench_sub)
    lora.add_parser(bench_sub)

    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `serve` re-runs itself with it
    _setup_logging(getattr(args, "log_level", None) or "info")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
