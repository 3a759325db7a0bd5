"""GRPO jobs on the fleet beyond one-turn dense rollouts: a multi-turn tool task (every turn
of a group on one worker, the conversation reused from its radix cache, only the model's
tokens trained) and MoE routing replay (the trainer computes the experts the rollout used)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from rl_helpers import chatml_copy
from serving_helpers import RAY_ENV, local_ray

from radixray.rl.config import GRPOConfig


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray(num_cpus=2) as address:
        yield address


def _cfg(model_dir: str, **over) -> GRPOConfig:
    data = {"model": model_dir, "task": "char_frequency", "steps": 2, "prompts_per_step": 2,
            "group_size": 4, "max_new_tokens": 6, "learning_rate": 3e-3,
            "micro_batch_size": 8, "held_out_prompts": 2, "seed": 1, "deterministic": True,
            "fleet": {"engine": {"dtype": "float32", "max_total_tokens": 4096},
                      "fleet": {"workers": 2}}}
    return GRPOConfig.parse({**data, **over})


def _rows(folder) -> list[dict]:
    return [json.loads(line) for line in open(folder / "metrics.jsonl")]


def test_a_tool_task_trains_on_the_fleet(ray_cluster, tiny_llama_dir, tmp_path):
    """Episodes of three turns: each group's turns all run on one worker, turns 2 and 3 find
    the conversation in its cache, and the deterministic trainer's logprobs of the model's
    tokens (the loss mask's) equal the rollout's exactly."""
    from radixray.rl.grpo import run
    from radixray.rl.job import Job
    model = chatml_copy(tiny_llama_dir, str(tmp_path / "model"))
    cfg = _cfg(model, task="rl_helpers:Echo", reward_function="rl_helpers:length_reward")
    job = Job(cfg)
    try:
        groups = job.rollout(job.task.problems(2, seed=5), 3, seed=2)
        for g in groups:
            workers = {t["worker_id"] for s in g.samples for t in s.turns}
            assert len(workers) == 1 and workers == {g.samples[0].worker_id}
            for s in g.samples:
                assert len(s.turns) == 3 and s.loss_mask.count(1) == sum(
                    t["output_tokens"] for t in s.turns)
                assert all(t["cached_tokens"] >= len(s.prompt_ids) for t in s.turns[1:]), s.turns
    except BaseException:
        job.close()
        raise
    run(cfg, str(tmp_path / "out"), job=job)
    rows = _rows(tmp_path / "out")
    assert [r["synced_version"] for r in rows] == [1, 2]
    for r in rows:
        assert r["turns_mean"] == 3.0 and r["cached_tokens_per_turn"][1] > 0
        assert r["logprob_abs_diff_max"] == 0.0 and r["tokens"] > 0


def test_moe_routing_replay_on_the_fleet(ray_cluster, tiny_qwen3_moe_dir, tmp_path):
    """A deterministic GRPO job on a tiny Qwen3-MoE: the rollouts bring back every token's
    experts (the fleet keeps routes of cached prefixes too), the trainer replays them, and
    the rollout/train difference is exactly 0 every step."""
    from radixray.rl.grpo import run
    cfg = _cfg(tiny_qwen3_moe_dir, steps=3, fleet={
        "engine": {"dtype": "float32", "max_total_tokens": 4096}, "fleet": {"workers": 1}})
    assert cfg.fleet.engine.enable_return_routed_experts
    run(cfg, str(tmp_path))
    rows = _rows(tmp_path)
    assert [r["synced_version"] for r in rows] == [1, 2, 3]
    assert all(r["logprob_abs_diff_max"] == 0.0 for r in rows), rows
    assert all(r["routing_flip_frac"] == 0.0 for r in rows), rows  # replayed, none flipped


@pytest.mark.slow
def test_the_calculator_config_runs_as_a_module(ray_cluster, tmp_path):
    """``python -m radixray.rl.grpo`` with the shipped tool-task config, joining the running
    cluster (as under ray job submit)."""
    env = {**os.environ, **RAY_ENV, "RAY_ADDRESS": ray_cluster}
    done = subprocess.run([sys.executable, "-m", "radixray.rl.grpo", "--config",
                           "configs/rl/grpo_calculator.yaml", "--steps", "1", "--output-dir",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    [row] = _rows(tmp_path)
    assert row["turns_mean"] >= 1 and row["tokens"] > 0
