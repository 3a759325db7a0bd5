"""GRPO training job: ``radixray rl grpo --config FILE`` or ``python -m radixray.rl.grpo --config FILE``.

Every step: sample ``group_size`` answers to ``prompts_per_step`` fresh problems through
the fleet, score them with the task's reward, normalise the rewards within each group,
take one GRPO step on the trainer, and push the new weights to every worker. Works under
``ray job submit --working-dir . -- python -m radixray.rl.grpo --config ...`` (it joins
the cluster in RAY_ADDRESS) and alone (it starts a local Ray). One JSON line per step goes
to ``OUTPUT_DIR/metrics.jsonl``; ``reward.png`` plots it; ``summary.json`` holds the
held-out scores before and after.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from radixray.rl.async_rollouts import AsyncBatches
from radixray.rl.batches import SyncBatches
from radixray.rl.config import GRPOConfig
from radixray.rl.job import Job
from radixray.rl.tasks import held_out

logger = logging.getLogger("radixray.rl")


def run(cfg: GRPOConfig, output_dir: str, steps: int | None = None, job: Job | None = None) -> dict:
    """Train for ``steps`` (default: the config's) on ``job`` (default: a new one, closed at
    the end either way); returns the summary."""
    from tqdm import tqdm
    os.makedirs(output_dir, exist_ok=True)
    job = job or Job(cfg)
    evaluation = held_out(job.task, cfg.held_out_prompts, cfg.seed)
    summary = held_out_summary(job.answers(evaluation), "before")
    path = os.path.join(output_dir, "metrics.jsonl")
    batches = None
    try:
        batches = (AsyncBatches if cfg.async_training else SyncBatches)(job, cfg, job.reward)
        start = time.perf_counter()
        trained_s = 0.0
        with open(path, "w") as out:
            for step in tqdm(range(steps or cfg.steps), desc="GRPO steps", unit="step"):
                t0 = time.perf_counter()
                batch = batches.next(step)
                version = batches.version
                stats = job.train(batch.samples)
                t1 = time.perf_counter()
                update = job.sync()
                batches.synced(update["weight_version"])
                now = time.perf_counter()
                trained_s += stats["train_s"]
                wall = now - start
                line = {"step": step, **batch.metrics, **stats, "weight_version": version,
                        "synced_version": update["weight_version"], "weight_sync_s": now - t1,
                        "step_s": now - t0, "tokens_per_s": stats["tokens"] / (now - t0),
                        "wall_s": wall, "trainer_idle_frac": max(0.0, 1 - trained_s / wall),
                        **batches.idle(wall), "sync_phases": update["phases"]}
                out.write(json.dumps(line) + "\n")
                out.flush()
        batches.close()
        summary.update(held_out_summary(job.answers(evaluation), "after"))
    finally:
        if batches is not None:
            batches.close()
        job.close()
    with open(os.path.join(output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot(path, os.path.join(output_dir, "reward.png"))
    return summary


HELD_OUT_EXAMPLES = 4  # held-out answers kept in summary.json, before and after training


def held_out_summary(answers: list[dict], when: str) -> dict:
    """The held-out score (mean reward of greedy answers) and the first few answers' texts,
    so a gain in format alone shows next to a gain in correctness."""
    mean = sum(a["reward"] for a in answers) / len(answers) if answers else float("nan")
    return {f"held_out_reward_{when}": mean,
            f"held_out_answers_{when}": answers[:HELD_OUT_EXAMPLES]}


def plot(metrics_path: str, out_path: str) -> None:
    """Reward (mean and std band) and the rollout-vs-train logprob difference over steps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        return
    steps = [r["step"] for r in rows]
    mean = [r["reward_mean"] for r in rows]
    std = [r["reward_std"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(steps, mean, label="reward mean")
    top.fill_between(steps, [m - s for m, s in zip(mean, std)],
                     [m + s for m, s in zip(mean, std)], alpha=0.2, label="± std")
    top.set_ylabel("reward")
    top.legend()
    bottom.plot(steps, [r["logprob_abs_diff_max"] for r in rows], label="max")
    bottom.plot(steps, [r["logprob_abs_diff_mean"] for r in rows], label="mean")
    bottom.set_ylabel("|rollout - train| logprob")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="a GRPO YAML config (configs/rl/)")
    p.add_argument("--steps", type=int, default=None, help="override the config's steps")
    p.add_argument("--output-dir", default="grpo_out", help="metrics.jsonl, reward.png, summary.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="radixray rl grpo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_cli(p.parse_args(argv))


def run_cli(args) -> int:
    """The job from parsed arguments: 2 (and the reason) for a bad config, else 0."""
    from radixray.cluster.config import ConfigError
    logging.basicConfig(level="INFO", format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    try:
        cfg = GRPOConfig.load(args.config)
        if args.steps is not None and args.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    except (ConfigError, OSError) as exc:
        print(f"radixray rl grpo: {exc}", file=sys.stderr)
        return 2
    summary = run(cfg, args.output_dir, args.steps)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
