"""Seconds from launching ``radixray serve`` to its first 200 from ``/ready``, for two source
trees side by side (each a checkout of radixray, e.g. ``git worktree add`` of an older
commit), alternating which goes first each pair so the host's drift falls on both alike.

    git worktree add /tmp/before 307ad94
    .venv/bin/python bench/serve_startup.py --tree before=/tmp/before --tree after=. \\
        --model tiny --pairs 4 --output-json startup.json

``--model tiny``: a random-weight tiny Llama written for the run (fp32, as the tests serve
it); ``--model default``: the default model (SmolLM2-135M, its default precision). Each
server is stopped with SIGTERM (a drain) before the next starts. Run it alone on the
machine, with the venv's Python (the trees run on it through PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false"}


def _model_args(model: str, repo: str) -> list[str]:
    if model == "default":
        return []
    sys.path[:0] = [os.path.join(repo, "tests"), repo]
    from model_fixtures import build_tiny_model
    return ["--model", build_tiny_model("llama", tempfile.mkdtemp()), "--dtype", "float32",
            "--max-total-tokens", "4096"]


def time_to_ready(tree: str, model_args: list[str], log: str) -> float:
    """Launch ``radixray serve`` from ``tree``; seconds until /ready answers 200; then drain it."""
    from radixray.bench.launch import free_port
    port = free_port()
    env = {**os.environ, **RAY_ENV, "PYTHONPATH": tree,
           "RAY_TMPDIR": os.path.join(tempfile.gettempdir(), f"r-startup-{os.getpid()}")}
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "radixray.cli", "serve", "--port",
                                 str(port), "--num-cpus", "2", *model_args], cwd=tree, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=60).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"radixray serve from {tree} exited {proc.returncode}: see {log}")
            time.sleep(0.2)
        seconds = time.monotonic() - t0
        proc.send_signal(signal.SIGTERM)
        proc.wait(300)
    return seconds


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", required=True, metavar="NAME=PATH",
                   help="a source tree to time (give two)")
    p.add_argument("--model", choices=("tiny", "default"), default="tiny")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    trees = dict(t.split("=", 1) for t in args.tree)
    names = list(trees)
    model_args = _model_args(args.model, os.path.abspath(trees[names[-1]]))
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.pairs):
        for name in (names if i % 2 == 0 else names[::-1]):
            log = os.path.join(tempfile.gettempdir(), f"serve_startup_{name}.log")
            seconds[name].append(time_to_ready(os.path.abspath(trees[name]), model_args, log))
            print(f"pair {i + 1}/{args.pairs} {name}: {seconds[name][-1]:.1f} s", flush=True)
    out = {"model": args.model, "pairs": args.pairs, "trees": trees,
           "seconds": {n: [round(s, 2) for s in v] for n, v in seconds.items()},
           "median_s": {n: round(statistics.median(v), 2) for n, v in seconds.items()}}
    print("medians: " + ", ".join(f"{n} {s:.1f} s" for n, s in out["median_s"].items()))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
