"""``radixray bench rl-async``: one GRPO config trained synchronously and asynchronously,
side by side.

Both runs use the config's seeds (the same problems, the same sampling seeds), placement
``separate`` (the trainer on one CPU bundle, each worker on its own) and a fresh fleet;
the synchronous run first, then the asynchronous one (``async: true``, ``max_staleness``
from the flag). Reported per run: wall time of the steps, reward at the last step and
averaged over the last five, held-out reward before and after, trainer and rollout idle
fractions, and the speed-up with the bound the synchronous run's split allows:

    bound = (rollout + train + sync) / (max(rollout, train) + sync)

(per step, medians of the synchronous run; rollouts do not advance while a weight update
holds the workers). Writes ``rl_async.json``, ``rl_async.png`` (reward against wall time)
and the runs' own outputs under ``--output-dir``.

    radixray bench rl-async --config configs/rl/grpo_smollm2.yaml --steps 30
"""

from __future__ import annotations

import json
import logging
import os
import statistics

logger = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("--config", default="configs/rl/grpo_smollm2.yaml", help="a GRPO config")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--held-out-prompts", type=int, default=None,
                   help="override the config's held-out problems (0 skips the evaluation)")
    p.add_argument("--output-dir", default="bench_rl_async")


def _config(path: str, asynchronous: bool, args):
    from radixray.rl.config import GRPOConfig
    over = {"placement": "separate", "async": asynchronous, "max_staleness": args.max_staleness}
    if args.held_out_prompts is not None:
        over["held_out_prompts"] = args.held_out_prompts
    return GRPOConfig.load(path, over)


def summarize(rows: list[dict], summary: dict) -> dict:
    """One run's figures from its metrics rows and summary."""
    last = rows[-1]
    med = {k: statistics.median(r.get(k, 0.0) for r in rows)
           for k in ("trainer_wait_s", "train_s", "weight_sync_s", "step_s")}
    return {"steps": len(rows), "wall_s": last["wall_s"],
            "reward_last": last["reward_mean"],
            "reward_last5": statistics.fmean(r["reward_mean"] for r in rows[-5:]),
            "held_out_before": summary.get("held_out_reward_before"),
            "held_out_after": summary.get("held_out_reward_after"),
            "trainer_idle_frac": last["trainer_idle_frac"],
            "rollout_idle_frac": last["rollout_idle_frac"], "median_s": med}


def bound(sync: dict) -> float:
    """The synchronous run's per-step split turned into the best async speed-up."""
    m = sync["median_s"]
    rollout, train, swap = m["trainer_wait_s"], m["train_s"], m["weight_sync_s"]
    return (rollout + train + swap) / (max(rollout, train) + swap)


def run(args) -> dict:
    from radixray.rl.grpo import run as train
    results = {"config": args.config, "steps": args.steps, "max_staleness": args.max_staleness}
    curves = {}
    for name, asynchronous in (("sync", False), ("async", True)):
        folder = os.path.join(args.output_dir, name)
        summary = train(_config(args.config, asynchronous, args), folder, args.steps)
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        results[name] = summarize(rows, summary)
        curves[name] = [(r["wall_s"], r["reward_mean"]) for r in rows]
    results["speedup"] = results["sync"]["wall_s"] / results["async"]["wall_s"]
    results["bound"] = bound(results["sync"])
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "rl_async.json"), "w") as f:
        json.dump(results, f, indent=2)
    _plot(curves, os.path.join(args.output_dir, "rl_async.png"))
    print(table(results))
    return results


def table(results: dict) -> str:
    lines = ["| run | wall s | reward at last step | last 5 | held-out before -> after | "
             "trainer idle | rollout idle |", "|---|---|---|---|---|---|---|"]
    for name in ("sync", "async"):
        r = results[name]
        lines.append(f"| {name} | {r['wall_s']:.0f} | {r['reward_last']:.3f} | "
                     f"{r['reward_last5']:.3f} | {r['held_out_before']} -> "
                     f"{r['held_out_after']} | {r['trainer_idle_frac']:.2f} | "
                     f"{r['rollout_idle_frac']:.2f} |")
    lines.append(f"\nspeed-up {results['speedup']:.2f}x (bound from the sync split: "
                 f"{results['bound']:.2f}x)")
    return "\n".join(lines)


def _plot(curves: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in curves.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=name)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("reward (step mean)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_parser(bench_subparsers) -> None:
    from radixray.bench import register
    register(bench_subparsers, "rl-async", "a GRPO config trained sync and async side by side",
             add_arguments, run)
