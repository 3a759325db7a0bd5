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
import statistics
import sys
import time

from radixray.rl.config import GRPOConfig
from radixray.rl.grpo_loss import group_advantages
from radixray.rl.job import Job
from radixray.rl.tasks import held_out

logger = logging.getLogger("radixray.rl")


def score(groups, reward, scale: bool) -> tuple[list[dict], list[float]]:
    """Each sample as the trainer takes it (with its group-normalised advantage), and the
    rewards in order. ``reward(text, problem)`` scores a sample."""
    import torch
    rewards = [[reward(s.text, g.problem) for s in g.samples] for g in groups]
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float32), scale=scale)
    samples = [s.trainer_dict(float(a))
               for g, row in zip(groups, adv) for s, a in zip(g.samples, row) if s.output_ids]
    return samples, [r for row in rewards for r in row]


def turn_stats(groups) -> dict:
    """A tool task's turns: mean model turns per episode and, per turn index, the mean
    cached tokens of its request (turn 2 on reuse the conversation so far)."""
    episodes = [s.turns for g in groups for s in g.samples if s.turns]
    if not episodes:
        return {}
    longest = max(map(len, episodes))
    cached = [statistics.fmean(t[k]["cached_tokens"] for t in episodes if len(t) > k)
              for k in range(longest)]
    return {"turns_mean": statistics.fmean(map(len, episodes)), "cached_tokens_per_turn": cached}


def run(cfg: GRPOConfig, output_dir: str, steps: int | None = None, job: Job | None = None) -> dict:
    """Train for ``steps`` (default: the config's) on ``job`` (default: a new one, closed at
    the end either way); returns the summary."""
    from tqdm import tqdm
    os.makedirs(output_dir, exist_ok=True)
    job = job or Job(cfg)
    evaluation = held_out(job.task, cfg.held_out_prompts, cfg.seed)
    summary = {"held_out_reward_before": job.evaluate(evaluation)}
    path = os.path.join(output_dir, "metrics.jsonl")
    try:
        with open(path, "w") as out:
            for step in tqdm(range(steps or cfg.steps), desc="GRPO steps", unit="step"):
                problems = job.task.problems(cfg.prompts_per_step, seed=cfg.seed * 1_000_003 + step)
                t0 = time.perf_counter()
                groups = job.rollout(problems, cfg.group_size, seed=cfg.seed * 7919 + step * 65_537)
                rollout_s = time.perf_counter() - t0
                samples, rewards = score(groups, job.reward, cfg.scale_advantages)
                stats = job.train(samples)
                t1 = time.perf_counter()
                update = job.sync()
                line = {"step": step, "reward_mean": statistics.fmean(rewards),
                        "reward_std": statistics.pstdev(rewards), **stats,
                        "weight_version": groups[0].samples[0].weight_version,
                        "synced_version": update["weight_version"], "rollout_s": rollout_s,
                        "weight_sync_s": time.perf_counter() - t1,
                        "tokens_per_s": stats["tokens"] / rollout_s,
                        "sync_phases": update["phases"], **turn_stats(groups)}
                out.write(json.dumps(line) + "\n")
                out.flush()
        summary["held_out_reward_after"] = job.evaluate(evaluation)
    finally:
        job.close()
    with open(os.path.join(output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot(path, os.path.join(output_dir, "reward.png"))
    return summary


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
