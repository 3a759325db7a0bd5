"""Asynchronous GRPO: the TIS-corrected loss, partial rollouts across weight updates
(continued in place, or aborted and resumed from their tokens), bounded staleness, and
dynamic sampling."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch
from serving_helpers import local_ray

from radixray.cluster.config import ConfigError
from radixray.rl.config import GRPOConfig
from radixray.rl.grpo_loss import grpo_loss
from radixray.rl.rollout import Group, Sample, join_outputs
from radixray.rl.tasks import Problem


def test_the_tis_loss_is_the_on_policy_loss_when_the_versions_agree():
    torch.manual_seed(0)
    behaviour = -torch.rand(3, 7) * 3
    mask = (torch.rand(3, 7) > 0.3).float()
    adv = torch.tensor([1.0, -0.5, 2.0])
    plain_logp = behaviour.clone().requires_grad_(True)
    plain, _ = grpo_loss(plain_logp, behaviour, adv, mask, total_tokens=20)
    plain.backward()
    tis_logp = behaviour.clone().requires_grad_(True)
    tis, stats = grpo_loss(tis_logp, tis_logp.detach(), adv, mask, total_tokens=20,
                           behaviour_logprobs=behaviour, tis_cap=2.0)
    tis.backward()
    assert torch.equal(tis, plain) and torch.equal(tis_logp.grad, plain_logp.grad)
    assert stats.tis_clip_frac == 0.0 and stats.mismatch_kl == 0.0


def test_the_tis_weight_reweights_and_truncates_stale_tokens():
    behaviour = torch.log(torch.tensor([[0.1, 0.5, 0.4]]))
    proximal = torch.log(torch.tensor([[0.4, 0.5, 0.2]]))  # weights 4 (-> 2), 1, 0.5
    logp = proximal.clone().requires_grad_(True)
    loss, stats = grpo_loss(logp, proximal, torch.tensor([1.0]), torch.ones(1, 3),
                            behaviour_logprobs=behaviour, tis_cap=2.0)
    loss.backward()
    # ratio 1 at the proximal policy: d(-w * ratio * A)/d logp = -w * A / 3 per token
    assert torch.allclose(logp.grad, torch.tensor([[-2.0, -1.0, -0.5]]) / 3)
    assert stats.tis_clip_frac == pytest.approx(1 / 3) and stats.mismatch_kl > 0
    with pytest.raises(ValueError, match="tis_cap must be >= 1"):
        grpo_loss(logp, proximal, torch.tensor([1.0]), torch.ones(1, 3),
                  behaviour_logprobs=behaviour, tis_cap=0.5)


def test_a_resumed_request_is_joined_with_its_version_spans():
    def out(ids, lps, version, spans=None, finish="abort"):
        meta = {"finish_reason": {"type": finish}, "weight_version": version,
                "cached_tokens": 3, "completion_tokens": len(ids)}
        if spans:
            meta["weight_versions"] = spans
        return {"output_ids": ids, "output_token_logprobs": lps, "meta_info": meta}
    first = out([1, 2, 3], [-0.1, -0.2, -0.3], 4)
    second = out([4, 5], [-0.4, -0.5], 5, finish="length")
    joined = join_outputs(first, second)
    assert joined["output_ids"] == [1, 2, 3, 4, 5]
    assert joined["output_token_logprobs"] == [-0.1, -0.2, -0.3, -0.4, -0.5]
    meta = joined["meta_info"]
    assert meta["finish_reason"] == {"type": "length"} and meta["resumed"] == 1
    assert meta["weight_versions"] == [{"weight_version": 4, "start": 0, "end": 3},
                                       {"weight_version": 5, "start": 3, "end": 5}]
    assert meta["completion_tokens"] == 5 and meta["cached_tokens"] == 3


def test_staleness_and_tokens_per_version_are_reported():
    from radixray.rl.batches import make_batch
    problem = Problem("t", "q", "a")

    def sample(versions, mask=None):
        return Sample([1], list(range(len(versions))), [-1.0] * len(versions), "x",
                      versions[-1], "w", 0, "length", loss_mask=mask, token_versions=versions)
    groups = [Group(problem, [sample([3, 3, 4]), sample([4, 4])]),
              Group(problem, [sample([2, 4, 4], mask=[0, 1, 1]), sample([4])])]
    batch = make_batch(groups, [[1.0, 0.0], [0.0, 0.5]], True, 4)
    assert batch.metrics["staleness"] == {"0": 3, "1": 1}  # a masked-out token does not count
    assert batch.metrics["tokens_per_version"] == {"3": 2, "4": 6}
    assert batch.metrics["multi_version_samples"] == 1
    assert len(batch.samples) == 4 and batch.metrics["reward_mean"] == pytest.approx(0.375)


def test_async_configs_are_checked():
    cfg = GRPOConfig.parse({"async": True, "placement": "separate", "max_staleness": 2})
    assert (cfg.async_training, cfg.pause_mode, cfg.loss_correction) == (True, "in_place", "tis")
    assert GRPOConfig.parse({}).pause_mode == "retract"
    with pytest.raises(ConfigError, match="async: true needs placement: separate"):
        GRPOConfig.parse({"async": True})
    with pytest.raises(ConfigError, match="max_staleness"):
        GRPOConfig.parse({"async": True, "placement": "separate", "max_staleness": -1})
    with pytest.raises(ConfigError, match="tis_cap"):
        GRPOConfig.parse({"tis_cap": 0.5})


# ---- on a Ray fleet -------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray(num_cpus=2) as address:
        yield address


def _cfg(model_dir: str, **over) -> GRPOConfig:
    data = {"model": model_dir, "task": "char_frequency", "steps": 4, "prompts_per_step": 2,
            "group_size": 4, "max_new_tokens": 8, "learning_rate": 3e-3,
            "micro_batch_size": 8, "held_out_prompts": 2, "seed": 2, "placement": "separate",
            "async": True, "max_staleness": 1,
            "fleet": {"engine": {"dtype": "float32", "max_total_tokens": 8192},
                      "fleet": {"workers": 1}}}
    return GRPOConfig.parse({**data, **over})


@pytest.mark.parametrize("mode", ["in_place", "abort"])
def test_a_weight_update_mid_generation_leaves_two_version_spans(ray_cluster, tiny_llama_dir,
                                                                 mode):
    """A group generating when the trainer's weights arrive: ``in_place`` continues it on
    the new weights, ``abort`` ends it and the rollout resumes it from its tokens; either
    way each sample's tokens carry both versions and it reaches its full length."""
    import ray

    from radixray.rl.job import Job
    job = Job(_cfg(tiny_llama_dir, pause_mode=mode))
    try:
        [entry] = ray.get(job.controller.live_workers.remote())
        handle = entry.handle
        before = ray.get(handle.snapshot.remote()).generation_tokens
        box = {}

        def roll():
            box["group"] = asyncio.run(job.rollouts.group(
                Problem("t", "Say something long.", ""), 2, 5,
                {"max_new_tokens": 900, "ignore_eos": True}))
        thread = threading.Thread(target=roll)
        thread.start()
        deadline = time.monotonic() + 300
        while ray.get(handle.snapshot.remote()).generation_tokens < before + 8:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        update = job.sync()
        thread.join(600)
        assert update["weight_version"] == 1
        for s in box["group"].samples:
            assert len(s.output_ids) == 900 and len(s.token_versions) == 900
            assert s.token_versions[0] == 0 and s.token_versions[-1] == 1
            assert sorted(set(s.token_versions)) == [0, 1] and s.oldest_version() == 0
    finally:
        job.close()


def test_async_training_bounds_staleness(ray_cluster, tiny_llama_dir, tmp_path):
    """max_staleness 1: no trained sample is more than one version old; every step reports
    the staleness histogram, tokens per version, the TIS stats and the idle fractions."""
    from radixray.rl.grpo import run
    run(_cfg(tiny_llama_dir, dynamic_sampling=True), str(tmp_path))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["synced_version"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert set(r["staleness"]) <= {"0", "1"}, r["staleness"]
        assert all(int(v) >= r["weight_version"] - 1 for v in r["tokens_per_version"])
        assert sum(r["tokens_per_version"].values()) == r["tokens"]
        for key in ("tis_clip_frac", "mismatch_kl", "trainer_idle_frac", "rollout_idle_frac",
                    "groups_dropped_stale", "groups_dropped_flat", "trainer_wait_s"):
            assert key in r, key
        assert 0 <= r["trainer_idle_frac"] <= 1 and 0 <= r["rollout_idle_frac"] <= 1
