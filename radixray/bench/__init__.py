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
