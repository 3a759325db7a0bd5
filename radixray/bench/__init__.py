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
