"""Benchmarks: offline engine throughput, the serving client (bench serve, cache-experiment), the naive baseline server."""


def save_json(results, path: str | None) -> None:
    """Write a benchmark's results to ``path`` as indented JSON; nothing when ``path`` is None."""
    if path:
        import json
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
