"""A GRPO job on a fleet that also serves HTTP, and the faults a job must survive.

One served app (two deterministic tiny-Llama workers, round-robin routing, priority
scheduling) is shared by every test: user requests keep being answered while a
deterministic job trains and broadcasts the weights (its rollout and train logprobs equal); a trainer that fails mid-update leaves every worker on the old version,
serving, and the job stops with the trainer's error; a worker that dies while it holds a
group gets that group resampled, whole, on the other worker.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import ray
from serving_helpers import free_port, serve_app, start_local_ray, tiny_config

from radixray.engine.faults import FailTrainerSend, FaultInjector
from radixray.rl.config import GRPOConfig


@pytest.fixture(scope="module")
def fleet_config(tiny_llama_dir):
    from ray import serve
    # Half a CPU per worker: the separate-placement trainer takes the cluster's other one.
    config = tiny_config(tiny_llama_dir, free_port(), worker_num_cpus=0.5)
    config["engine"].update(enable_priority_scheduling=True, deterministic=True)
    config["fleet"] = {"workers": 2}
    config["router"] = {"policy": "round_robin"}
    start_local_ray()
    try:
        base = serve_app(config)
        yield config, base
    finally:
        serve.shutdown()
        ray.shutdown()


def _job_config(config: dict, **over) -> GRPOConfig:
    fleet = {k: v for k, v in config.items() if k in ("engine", "fleet", "router", "server")}
    data = {"model": config["engine"]["model"], "task": "char_frequency", "steps": 2,
            "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8,
            "learning_rate": 1e-3, "micro_batch_size": 8, "held_out_prompts": 0,
            "placement": "separate", "fleet": fleet}
    return GRPOConfig.parse({**data, **over})


def _versions(job) -> set[int]:
    loads = [ray.get(ray.get(job.controller.worker.remote(w)).handle.load.remote())
             for w in ("worker-0", "worker-1")]
    return {load.weight_version for load in loads}


def test_user_requests_are_answered_while_a_job_trains_and_updates(fleet_config, tmp_path):
    """The job attaches to the served fleet (same fleet section: it does not start its own)
    and runs two separate-placement steps with rollouts at priority -1, while a user keeps
    sending chat requests; every one of them gets a full answer."""
    from radixray.rl.grpo import run
    from radixray.rl.job import Job
    config, base = fleet_config
    job = Job(_job_config(config, steps=4, deterministic=True))
    assert not job.owns_fleet
    (start,) = _versions(job)
    answers: list[int] = []
    during: list[int] = []
    stop = threading.Event()

    def user() -> None:
        with httpx.Client(base_url=base, timeout=120) as client:
            while not stop.is_set():
                r = client.post("/v1/chat/completions", json={
                    "model": "tiny", "max_tokens": 6, "temperature": 0,
                    "messages": [{"role": "user", "content": "Hello world"}]})
                answers.append(r.status_code if r.status_code != 200 or
                               r.json()["choices"][0]["finish_reason"] in ("length", "stop")
                               else -1)

    thread = threading.Thread(target=user)
    thread.start()
    try:
        while not answers:  # the user is being served before the job starts
            time.sleep(0.05)
        first = len(answers)
        run(job.cfg, str(tmp_path), job=job)  # closes the job, not the served fleet
        during = answers[first:]
    finally:
        stop.set()
        thread.join()
    assert during and set(answers) == {200}, answers
    assert _versions(job) == {start + job.cfg.steps}
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["synced_version"] - start for r in rows] == [1, 2, 3, 4]
    assert all("release" not in r["sync_phases"] for r in rows)  # separate: nothing released
    assert [r["logprob_abs_diff_max"] for r in rows] == [0.0] * 4  # exactly the sent weights
    assert httpx.get(f"{base}/ready").status_code == 200


@pytest.mark.slow  # out of the default run's 15-minute budget: make test-slow
def test_a_trainer_failing_mid_update_leaves_the_old_version_serving(fleet_config, tmp_path):
    """Colocated (workers paused, memory released while training) and separate (a broadcast
    cut half way): the sync raises the trainer's error, every worker keeps its version and
    answers requests again."""
    from radixray.rl.batches import score
    from radixray.rl.job import Job
    from radixray.rl.registry import get_task
    config, base = fleet_config
    for placement, phase in (("colocated", "write_shared"), ("separate", "broadcast")):
        job = Job(_job_config(config, placement=placement))
        try:
            before = _versions(job)
            groups = job.rollout(get_task("char_frequency").problems(2, seed=1), 4, seed=1)
            samples, _ = score(groups, job.reward, True)
            job.train(samples)
            ray.get(job.trainer.attach_fault_injector.remote(
                FaultInjector(FailTrainerSend(phase))))
            with pytest.raises(Exception, match=f"injected trainer fault during {phase}"):
                job.sync()
            assert _versions(job) == before, placement
            r = httpx.post(f"{base}/generate", json={"text": "Hello", "sampling_params": {
                "max_new_tokens": 4, "temperature": 0}}, timeout=120)
            assert r.status_code == 200, (placement, r.text)
        finally:
            job.close()


def test_a_worker_dying_mid_rollout_gets_its_group_resampled(fleet_config):
    """worker-0 is paused (its group waits in its queue, so the kill is sure to land
    mid-group) and then killed: that group comes back whole from worker-1."""
    from radixray.rl.job import Job
    config, _ = fleet_config
    job = Job(_job_config(config))
    try:
        victim = ray.get(job.controller.worker.remote("worker-0")).handle
        ray.get(victim.pause_generation.remote("in_place"))
        result: dict = {}
        problems = job.task.problems(2, seed=5)
        thread = threading.Thread(target=lambda: result.update(
            groups=job.rollout(problems, 4, seed=2)))
        thread.start()
        while ray.get(victim.load.remote()).num_queue_reqs < 4:
            time.sleep(0.05)
        ray.kill(victim)
        thread.join()
        groups = result["groups"]
        assert [len(g.samples) for g in groups] == [4, 4]
        assert all({s.worker_id for s in g.samples} == {"worker-1"} for g in groups)
    finally:
        job.close()
