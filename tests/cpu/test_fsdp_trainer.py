"""The sharded trainer (FSDP2 over gloo, Ray actors): a 2-rank group's steps equal the
1-process PolicyTrainer's (uneven splits, a rank with no samples, KL reference sharded
too), its weight-out calls gather the full weights on rank 0, and a colocated GRPO job
with trainer_ranks: 2 learns the toy task with rollout and train logprobs equal to the bit."""

from __future__ import annotations

import json
import random

import pytest
import torch
from serving_helpers import local_ray

from radixray.cluster.config import ConfigError
from radixray.rl.config import GRPOConfig

OPTIONS = {"learning_rate": 1e-3, "weight_decay": 0.01, "kl_coef": 0.05, "clip_low": 0.2,
           "clip_high": 0.28, "micro_batch_size": 2}


@pytest.fixture(scope="module")
def ray_cluster():
    # 3 CPUs: the separate-placement job's two trainer ranks take one each, its worker one
    with local_ray(num_cpus=3) as address:
        yield address


def _samples(trainer, n: int, seed: int) -> list[dict]:
    """``n`` plausible rollout samples: random prompts and outputs of varied lengths, the
    outputs' logprobs from the trainer's own forward nudged by noise (so ratios differ from
    1 and some clip), advantages +-1; an extra key rides along untouched."""
    from radixray.rl.trainer import pad_batch
    rng = random.Random(seed)
    vocab = trainer.model.config.vocab_size
    samples = []
    for i in range(n):
        samples.append({"prompt_ids": [rng.randrange(1, vocab) for _ in range(rng.randint(2, 9))],
                        "output_ids": [rng.randrange(1, vocab) for _ in range(rng.randint(1, 12))],
                        "advantage": 1.0 if i % 2 else -1.0, "routed_experts": None})
        samples[-1]["logprobs"] = [0.0] * len(samples[-1]["output_ids"])
    batch = pad_batch(samples, "cpu")
    with torch.no_grad():
        logprobs = trainer._logprobs(trainer.model, batch)
    for i, s in enumerate(samples):
        start = len(s["prompt_ids"]) - 1
        own = logprobs[i, start:start + len(s["output_ids"])].tolist()
        s["logprobs"] = [x + rng.uniform(-0.3, 0.3) for x in own]
    return samples


def _max_diff(a: dict, b: dict) -> float:
    assert list(a) == list(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("learning_rate, sizes", [
    (1e-3, (4, 4, 8)),  # whole micro-batches on each rank: the same forwards as one process
    (1e-5, (5, 1, 3)),  # ranks get 3 and 2 (an idle pass), then 1 and 0 (rank 1 all idle)
])
def test_two_fsdp_ranks_step_like_one_trainer(ray_cluster, tiny_llama_dir, learning_rate,
                                              sizes):
    """Three steps on a 2-rank group and on one PolicyTrainer from the same checkpoint (KL
    on, so the reference is sharded too): after each, every parameter agrees within 1e-6
    and the statistics match. AdamW's first steps move a weight by about lr * g / |g|, so a
    gradient element near 0 turns float noise into a visible step: when the split changes
    the micro-batches' padding (and so their rounding), a lower learning rate keeps that
    noise under the bound (seen: 7e-8 at 1e-3 aligned, 1.6e-7 at 1e-5 uneven, 1.7e-5 at
    1e-3 uneven)."""
    from radixray.rl.trainer import PolicyTrainer
    from radixray.rl.trainer_group import TrainerGroup
    options = {**OPTIONS, "learning_rate": learning_rate}
    single = PolicyTrainer(tiny_llama_dir, options, num_threads=1)
    initial = {k: v.clone() for k, v in single.named_weights().items()}
    group = TrainerGroup([{"num_cpus": 0}] * 2, tiny_llama_dir, options, num_threads=1)
    try:
        assert group.weight_spec() == single.weight_spec()
        for step, n in enumerate(sizes):
            samples = _samples(single, n, seed=step)
            want = single.train_step(samples)
            got = group.train_step(samples)
            assert got.keys() == want.keys()
            assert got["tokens"] == want["tokens"] == sum(len(s["output_ids"]) for s in samples)
            for key in ("loss", "grad_norm", "clip_frac", "kl", "ratio_max",
                        "logprob_abs_diff_max", "logprob_abs_diff_mean"):
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, key)
            assert _max_diff(group.named_weights(), single.named_weights()) < 1e-6, step
        assert want["clip_frac"] > 0 and want["kl"] > 0  # the clip and the KL term took part
        assert _max_diff(single.named_weights(), initial) > 2 * learning_rate  # they moved
    finally:
        group.close()


def test_weights_leave_rank_0_full(ray_cluster, tiny_llama_dir):
    """Every weight-out call gathers the full tensors (all ranks take part) and rank 0
    sends them: the shared-memory file, the object-store payload and the broadcast to a
    weight-update group all carry the 1-process trainer's weights."""
    from concurrent.futures import ThreadPoolExecutor

    import ray

    from radixray.cluster.shared_weights import read_shared
    from radixray.cluster.tensor_payload import from_payload
    from radixray.engine.weights.sync import broadcast, close_group, dtype_from_name, open_group
    from radixray.rl.trainer import PolicyTrainer
    from radixray.rl.trainer_group import TrainerGroup
    want = PolicyTrainer(tiny_llama_dir, OPTIONS, num_threads=1).named_weights()
    group = TrainerGroup([{"num_cpus": 0}] * 2, tiny_llama_dir, OPTIONS, num_threads=1)
    try:
        shared = dict(read_shared(group.write_shared()))
        assert _max_diff(shared, want) == 0.0
        payload = dict(from_payload(ray.get(group.put_payload())))
        assert _max_diff(payload, want) == 0.0
        names, dtypes, shapes = group.weight_spec()
        address, port = group.broadcast_address()
        with ThreadPoolExecutor(1) as pool:
            opened = pool.submit(group.open_broadcast, address, port, 2)
            receiver = open_group(address, port, 1, 2)
            opened.result()
            sent = pool.submit(group.broadcast)
            got = {}
            for name, dtype, shape in zip(names, dtypes, shapes):
                got[name] = torch.empty(shape, dtype=dtype_from_name(dtype))
                broadcast(receiver, got[name])
            assert sent.result() == sum(t.numel() * t.element_size() for t in want.values())
        close_group(receiver)
        assert _max_diff(got, want) == 0.0
    finally:
        group.close()


def test_deterministic_ranks_score_exactly_across_weight_updates(ray_cluster, tiny_qwen3_dir):
    """Deterministic mode with 2 ranks (Qwen3: tied embeddings, one root-unit parameter):
    each rank's scorer holds the gathered weights, so the train logprobs equal a
    deterministic engine's before and after the group's weights reach it."""
    from radixray import Engine
    from radixray.rl.trainer_group import TrainerGroup
    options = {"learning_rate": 1e-2, "clip_low": 0.2, "clip_high": 0.2, "micro_batch_size": 2}
    group = TrainerGroup([{"num_cpus": 0}] * 2, tiny_qwen3_dir, options, num_threads=1,
                         deterministic=True)
    prompts = [[5, 9, 13, 21, 34], [7, 7, 8], list(range(40, 80))]
    params = {"temperature": 1.0, "return_logprob": True, "return_unscaled_logprob": True,
              "ignore_eos": True, "max_new_tokens": 12}

    def rollout(eng) -> list[dict]:
        outs = eng.generate(input_ids=prompts, sampling_params=[
            {**params, "seed": i} for i in range(len(prompts))])
        return [{"prompt_ids": p, "output_ids": o["output_ids"], "advantage": (-1.0) ** i,
                 "logprobs": o["output_token_logprobs"]}
                for i, (p, o) in enumerate(zip(prompts, outs))]
    try:
        with Engine(model=tiny_qwen3_dir, deterministic=True, max_total_tokens=4096,
                    chunked_prefill_size=16) as eng:
            first = group.train_step(rollout(eng))
            eng.begin_weight_update()
            eng.update_weights_from_tensor(list(group.named_weights().items()))
            eng.end_weight_update(1)
            second = group.train_step(rollout(eng))
    finally:
        group.close()
    for stats in (first, second):
        assert stats["tokens"] == 36 and stats["grad_norm"] > 0
        assert stats["logprob_abs_diff_max"] == 0.0 and stats["ratio_max"] == 1.0


def test_split_evenly_keeps_order_and_balance():
    from radixray.rl.fsdp import split_evenly
    assert split_evenly(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    assert split_evenly([7], 3) == [[7], [], []]
    assert split_evenly(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]


def test_decoder_layers_are_the_units(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from radixray.rl.fsdp import decoder_layers
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert decoder_layers(model) == list(model.model.layers)
    fsdp_class = type("FSDPLlamaDecoderLayer", (type(model.model.layers[0]),), {})
    model.model.layers[0].__class__ = fsdp_class  # as fully_shard renames a unit's class
    assert decoder_layers(model) == list(model.model.layers)


@pytest.mark.parametrize("value, message", [
    (0, "trainer_ranks: Input should be greater than or equal to 1"),
    (65, "trainer_ranks: Input should be less than or equal to 64"),
    ("two", "trainer_ranks: Input should be a valid integer"),
])
def test_bad_trainer_ranks_name_the_field(value, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig.parse({"trainer_ranks": value})


def test_placement_reserves_a_bundle_per_rank(tiny_llama_dir):
    from radixray.rl.placement import trainer_memory_bytes
    one = trainer_memory_bytes(tiny_llama_dir, kl=False, deterministic=False)
    two = trainer_memory_bytes(tiny_llama_dir, kl=False, deterministic=False, ranks=2)
    assert two == one * 3 // 4  # half of 4 copies, plus the gathered full weights


@pytest.mark.slow  # ~19 s (test_grpo_job learns the one-rank toy task in the quick run)
def test_grpo_learns_a_toy_task_with_two_trainer_ranks(ray_cluster, tiny_llama_dir, tmp_path):
    """As test_grpo_job's colocated deterministic run, with a 2-rank FSDP trainer: two
    memory-only trainer bundles before the workers'; rollout and train logprobs equal."""
    import ray

    from radixray.rl.grpo import run
    from radixray.rl.job import Job
    data = {"model": tiny_llama_dir, "task": "char_frequency", "steps": 12,
            "prompts_per_step": 4, "group_size": 6, "max_new_tokens": 16,
            "learning_rate": 3e-3, "clip_high": 0.28, "micro_batch_size": 24,
            "held_out_prompts": 4, "seed": 3, "deterministic": True, "trainer_ranks": 2,
            "fleet": {"engine": {"dtype": "float32", "max_total_tokens": 4096},
                      "fleet": {"workers": 2}}}
    job = Job(GRPOConfig.parse(data))
    try:
        groups = [g for g in ray.util.placement_group_table().values()
                  if g["state"] == "CREATED"]
        assert [(g["name"][:5], len(g["bundles"])) for g in groups] == [("grpo-", 4)], groups
        assert [set(groups[0]["bundles"][i]) for i in (0, 1)] == [{"memory"}, {"memory"}]
        assert {"CPU"} <= set(groups[0]["bundles"][2])  # the workers' bundles follow
    except BaseException:
        job.close()
        raise
    summary = run(job.cfg, str(tmp_path), job=job)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["synced_version"] for r in rows] == list(range(1, 13))
    assert [r["weight_version"] for r in rows] == list(range(0, 12))
    first = sum(r["reward_mean"] for r in rows[:3]) / 3
    last = sum(r["reward_mean"] for r in rows[-3:]) / 3
    assert last > 2 * first and last > 0.1, [r["reward_mean"] for r in rows]
    assert all(r["logprob_abs_diff_max"] == 0.0 for r in rows)  # true on-policy
    assert "held_out_reward_after" in summary


def test_a_separate_job_broadcasts_from_rank_0(ray_cluster, tiny_llama_dir):
    """placement: separate with 2 trainer ranks (a CPU bundle each, before the worker's):
    two deterministic steps whose rollouts run on the broadcast weights score exactly; a
    broadcast cut short by an injected fault on rank 0 leaves the worker on its version."""
    import ray

    from radixray.engine.faults import FailTrainerSend, FaultInjector
    from radixray.rl.batches import score
    from radixray.rl.job import Job
    data = {"model": tiny_llama_dir, "task": "char_frequency", "prompts_per_step": 2,
            "group_size": 4, "max_new_tokens": 8, "learning_rate": 1e-3,
            "micro_batch_size": 8, "held_out_prompts": 0, "placement": "separate",
            "deterministic": True, "trainer_ranks": 2,
            "fleet": {"engine": {"max_total_tokens": 4096}, "fleet": {"workers": 1}}}
    job = Job(GRPOConfig.parse(data))

    def version() -> int:
        handle = ray.get(job.controller.worker.remote("worker-0")).handle
        return ray.get(handle.load.remote()).weight_version

    def train(seed: int) -> dict:
        groups = job.rollout(job.task.problems(2, seed=seed), 4, seed=seed)
        return job.train(score(groups, job.reward, True)[0])
    try:
        bundles = ray.util.placement_group_table(job.placement.group)["bundles"]
        assert [bundles[i] for i in (0, 1)] == [{"CPU": 1.0}, {"CPU": 1.0}], bundles
        for step in range(2):
            assert train(step)["logprob_abs_diff_max"] == 0.0
            assert job.sync()["weight_version"] == step + 1 == version()
        train(2)
        ray.get(job.trainer.attach_fault_injector.remote(
            FaultInjector(FailTrainerSend("broadcast"))))
        with pytest.raises(Exception, match="injected trainer fault during broadcast"):
            job.sync()
        assert version() == 2
    finally:
        job.close()
