"""Training batches from rollouts: scoring, dynamic sampling, and what each step reports.

A :class:`Batch` is what one GRPO step trains on: the groups, their rewards, the samples
as the trainer takes them (with group-normalised advantages) and the step's rollout
metrics. :class:`SyncBatches` samples a batch while the trainer waits (the synchronous
loop); :class:`~radixray.rl.async_rollouts.AsyncBatches` keeps sampling in the background.

Dynamic sampling (DAPO): a group whose rewards are all equal has advantage 0 everywhere
and teaches nothing, so with ``dynamic_sampling`` such groups are dropped and more are
sampled to refill the batch (synchronously: up to ``dynamic_sampling_max_rounds`` rounds
of fresh problems; the batch may come out smaller when the rounds run out).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

from radixray.rl.grpo_loss import group_advantages


@dataclass
class Batch:
    groups: list  # of rollout.Group
    rewards: list[list[float]]  # per group, per sample
    samples: list[dict]  # the trainer's input
    metrics: dict = field(default_factory=dict)


def score(groups, reward, scale: bool) -> tuple[list[dict], list[float]]:
    """Each sample as the trainer takes it (with its group-normalised advantage), and the
    rewards in order. ``reward(text, problem)`` scores a sample."""
    rewards = [[reward(s.text, g.problem) for s in g.samples] for g in groups]
    return _samples(groups, rewards, scale), [r for row in rewards for r in row]


def _samples(groups, rewards: list[list[float]], scale: bool) -> list[dict]:
    import torch
    if not groups:
        return []
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float32), scale=scale)
    return [s.trainer_dict(float(a))
            for g, row in zip(groups, adv) for s, a in zip(g.samples, row) if s.output_ids]


def is_flat(rewards: list[float]) -> bool:
    """Every sample of the group scored the same (no learning signal)."""
    return all(r == rewards[0] for r in rewards)


def make_batch(groups, rewards: list[list[float]], scale: bool, version, **metrics) -> Batch:
    """The batch of ``groups`` trained by the policy of weight ``version``, with its metrics."""
    flat = [r for row in rewards for r in row] or [0.0]
    out = {"reward_mean": statistics.fmean(flat), "reward_std": statistics.pstdev(flat),
           "groups": len(groups), **version_metrics(groups, version), **turn_stats(groups),
           **metrics}
    return Batch(groups, rewards, _samples(groups, rewards, scale), out)


def version_metrics(groups, version) -> dict:
    """Staleness of the trained samples against the trainer's ``version`` (a histogram:
    versions behind -> samples), model tokens per weight version, and how many samples
    lived through a weight update (tokens of two versions or more)."""
    staleness: Counter = Counter()
    tokens: Counter = Counter()
    spanning = 0
    for g in groups:
        for s in g.samples:
            oldest = s.oldest_version()
            behind = version - oldest if isinstance(version, int) and isinstance(oldest, int) \
                else "unknown"
            staleness[str(behind)] += 1
            versions = s.token_versions or [s.weight_version] * len(s.output_ids)
            mask = s.loss_mask or [1] * len(versions)
            trained = [v for v, m in zip(versions, mask) if m]
            tokens.update(str(v) for v in trained)
            spanning += len(set(trained)) > 1
    return {"staleness": dict(sorted(staleness.items())),
            "tokens_per_version": dict(sorted(tokens.items())), "multi_version_samples": spanning}


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


class SyncBatches:
    """The synchronous loop's batches: step ``s`` samples ``prompts_per_step`` fresh
    problems with the weights of the last sync, while the trainer waits."""

    def __init__(self, job, cfg, reward):
        self.job, self.cfg, self.reward = job, cfg, reward
        self.version = job.weight_version()  # the policy the trainer trains next
        self.rollout_busy_s = 0.0

    def next(self, step: int) -> Batch:
        cfg = self.cfg
        t0 = time.perf_counter()
        kept, dropped, rounds = [], [], 0
        while len(kept) < cfg.prompts_per_step and rounds < self._max_rounds():
            want = cfg.prompts_per_step - len(kept)
            problems = self.job.task.problems(want, seed=problem_seed(cfg, step, rounds))
            groups = self.job.rollout(problems, cfg.group_size,
                                      seed=sample_seed(cfg, step) + rounds * 7_777_777)
            for g in groups:
                row = [self.reward(s.text, g.problem) for s in g.samples]
                (dropped if cfg.dynamic_sampling and is_flat(row) else kept).append((g, row))
            rounds += 1
        rollout_s = time.perf_counter() - t0
        self.rollout_busy_s += rollout_s
        metrics = {"rollout_s": rollout_s, "trainer_wait_s": rollout_s}
        if cfg.dynamic_sampling:
            metrics.update(groups_dropped_flat=len(dropped), sampling_rounds=rounds)
        kept = kept or dropped  # every round flat: train on them (advantage 0, no update)
        return make_batch([g for g, _ in kept], [r for _, r in kept], cfg.scale_advantages,
                          self.version, **metrics)

    def _max_rounds(self) -> int:
        return self.cfg.dynamic_sampling_max_rounds if self.cfg.dynamic_sampling else 1

    def synced(self, version) -> None:
        """The trainer's weights are now ``version`` on every worker."""
        self.version = version

    def idle(self, wall_s: float) -> dict:
        return {"rollout_idle_frac": max(0.0, 1 - self.rollout_busy_s / wall_s)}

    def close(self) -> None:
        pass


def problem_seed(cfg, step: int, rounds: int = 0) -> int:
    """The seed of step ``step``'s problems (``rounds`` > 0: a dynamic-sampling refill)."""
    return cfg.seed * 1_000_003 + step + rounds * 104_729_000


def sample_seed(cfg, step: int) -> int:
    """The sampling seed of step ``step``'s first sample."""
    return cfg.seed * 7919 + step * 65_537
