"""Benchmarks: offline engine throughput, the serving client (bench serve, cache-experiment), the naive baseline server."""


def save_json(results, path: str | None) -> None:
    """Write a benchmark's results to ``path`` as indented JSON; nothing when ``path`` is None."""
    if path:
        import json
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


def random_token_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of exactly ``length`` token ids drawn from [100, vocab) (past the
    special tokens), reproducible from ``seed``."""
    import random
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def add_engine_arguments(p) -> None:
    """The engine options an in-process benchmark takes: model, dtype, int8, KV dtype."""
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M GGUF), an HF folder or a .gguf")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--quantization", default=None, choices=["w8a8_int8"])
    p.add_argument("--quantize-lm-head", action="store_true")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "fp8_e5m2"])


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
