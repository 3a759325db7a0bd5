"""The parts of a GRPO job on Ray: the fleet, the trainer actor, rollouts and weight sync.

:class:`Job` joins the fleet of the config's ``fleet`` section (starting it when no app
with that configuration runs on the cluster), starts the trainer actor, and gives the
driver four calls per step: :meth:`Job.rollout`, :meth:`Job.train`, :meth:`Job.sync`
and, around the run, :meth:`Job.evaluate`. Placement decides what happens around
training:

- ``colocated``: before the trainer trains, every worker pauses and releases its
  ``kv_cache`` and ``weights``; afterwards they come back and the new weights arrive
  through ``update_weights_from_tensor`` from the trainer's shared-memory file (workers
  on another node than the trainer's: from the object store, logged once).
- ``separate``: the workers keep serving while the trainer trains; the new weights arrive
  by broadcast from the trainer (rank 0) over torch.distributed (gloo on CPU).

Either way the update is the fleet-wide all-or-none session of the control plane, so a
trainer that fails mid-update leaves every worker on the old version. The trainer and,
when the job starts the fleet, every worker share one placement group
(:mod:`radixray.rl.placement`). With ``trainer_ranks`` > 1 the trainer is a
:class:`~radixray.rl.trainer_group.TrainerGroup` actor driving that many FSDP ranks, with
the single trainer's calls.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid

from radixray.cluster.weight_sources import DistributedWeights, TensorWeights
from radixray.engine.control import MEMORY_TAGS
from radixray.engine.models.moe import MOE_MODEL_TYPES
from radixray.rl.config import GRPOConfig
from radixray.rl.placement import JobPlacement, trainer_memory_bytes
from radixray.rl.rollout import Group, RolloutManager

logger = logging.getLogger("radixray.rl")


def connect_ray(namespace: str) -> None:
    """Join the cluster ``ray job submit`` runs us on (RAY_ADDRESS), else start a local one
    on loopback."""
    import ray
    if ray.is_initialized():
        return
    for key, value in (("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"), ("RAY_AUTH_MODE", "disabled"),
                       ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], namespace=namespace, log_to_driver=False)
    else:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, namespace=namespace,
                 log_to_driver=False)


def _check(results: dict, what: str) -> dict:
    """A controller fan-out's results; RuntimeError naming each worker that refused."""
    errors = {w: r["error"] for w, r in results.items() if isinstance(r, dict) and "error" in r}
    if errors:
        raise RuntimeError(f"{what} failed on " + "; ".join(f"{w}: {e}" for w, e in errors.items()))
    return results


class Job:
    """A GRPO run's Ray side; see the module docstring."""

    def __init__(self, cfg: GRPOConfig):
        import ray

        from radixray.engine.weights.loader import resolve_model
        from radixray.rl.registry import get_task
        from radixray.rl.trainer import trainer_actor_class
        from radixray.serve.fleet import (
            find_controller,
            find_router,
            get_or_create_controller,
            start_heartbeats,
        )
        self.cfg = cfg
        serve_cfg = cfg.serve_config()
        connect_ray(serve_cfg.namespace)
        if find_controller(serve_cfg) is None:  # not served: the job's own (exact) fleet
            serve_cfg = cfg.own_fleet_config()
            self.cfg = cfg = cfg.model_copy(update={"fleet": serve_cfg})
        elif not (serve_cfg.engine.exact or serve_cfg.engine.deterministic
                  or serve_cfg.engine.quantization not in (None, "auto")):
            logger.info("joining a served fleet that picks its precision per CPU (quantized "
                        "on AVX-512 VNNI/AMX): rollout logprobs may then differ from the "
                        "trainer's fp32 ones; serve it with engine.exact: true to match")
        self.owns_fleet = find_controller(serve_cfg) is None
        self.controller = get_or_create_controller(serve_cfg)
        self._heartbeats = start_heartbeats(self.controller, f"grpo-{uuid.uuid4().hex[:8]}",
                                            serve_cfg.fleet.owner_timeout_s / 4)
        source = resolve_model(cfg.model)
        device = serve_cfg.engine.device
        worker_bundles = serve_cfg.worker_bundles() if self.owns_fleet else []
        self.placement = JobPlacement(
            cfg.placement, device, trainer_memory_bytes(source.path, cfg.kl_coef > 0,
                                                        cfg.deterministic, cfg.trainer_ranks),
            worker_bundles, serve_cfg.fleet.placement_strategy, cfg.trainer_ranks)
        self.placement.ready()
        if self.owns_fleet and worker_bundles:
            ray.get(self.controller.adopt_placement_group.remote(self.placement.group,
                                                                 cfg.trainer_ranks))
        ray.get(self.controller.start.remote())
        self.router = find_router(serve_cfg)
        self.task = get_task(cfg.task)
        self.reward = cfg.reward_fn(self.task)
        sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p,
                    "max_new_tokens": cfg.max_new_tokens}
        if cfg.routing_replay and getattr(source.config, "model_type", None) in MOE_MODEL_TYPES:
            sampling["return_routed_experts"] = True  # the trainer replays them
        self.rollouts = RolloutManager(
            self.controller, self.router, source.tokenizer, sampling,
            priority=cfg.rollout_priority, task=self.task, rollout_function=cfg.rollout_fn(),
            resume_aborted=cfg.async_training and cfg.pause_mode == "abort")
        options = {k: getattr(cfg, k) for k in ("learning_rate", "weight_decay", "kl_coef",
                                                "clip_low", "clip_high", "micro_batch_size",
                                                "routing_replay", "loss_correction",
                                                "tis_cap")}
        threads = self.placement.trainer_options["num_cpus"] or None  # colocated: every core
        if cfg.trainer_ranks > 1:  # an FSDP group, driven by an actor of its own
            from radixray.rl.trainer_group import trainer_group_actor_class
            ranks = [self.placement.trainer(r) for r in range(cfg.trainer_ranks)]
            self.trainer = trainer_group_actor_class().options(num_cpus=0).remote(
                ranks, source.path, options, device, cfg.seed, threads, cfg.deterministic)
        else:
            self.trainer = trainer_actor_class().options(**self.placement.trainer()).remote(
                source.path, options, device, cfg.seed, threads, cfg.deterministic)
        self.workers = len(ray.get(self.controller.live_workers.remote()))
        self._told_off_node = False  # logged once: workers off the trainer's node
        if cfg.placement == "separate":
            self._open_broadcast()

    def _open_broadcast(self) -> None:
        import ray
        # rank 0 (the trainer) listens on its own node, wherever the workers are
        address, port = ray.get(self.trainer.broadcast_address.remote())
        joined = self.controller.init_weights_update_group.remote(address, port, self.workers + 1)
        ray.get([self.trainer.open_broadcast.remote(address, port, self.workers + 1), joined])
        self.spec = ray.get(self.trainer.weight_spec.remote())

    def weight_version(self):
        """The version of the weights the fleet serves now."""
        import ray
        return ray.get(self.controller.get_weight_version.remote())["weight_version"]

    def rollout(self, problems, n: int, seed: int | None, sampling: dict | None = None) -> list[Group]:
        return asyncio.run(self.rollouts.rollout(problems, n, seed, sampling))

    def train(self, samples: list[dict]) -> dict:
        """One optimizer step; colocated, the workers give their memory back meanwhile (and
        take it back if training fails, so the fleet keeps serving the old weights)."""
        import ray
        if self.cfg.placement == "colocated":
            _check(ray.get(self.controller.pause_generation.remote(self.cfg.pause_mode)), "pause")
            _check(ray.get(self.controller.release_memory_occupation.remote(
                list(MEMORY_TAGS))), "release_memory_occupation")
        try:
            return ray.get(self.trainer.train_step.remote(samples))
        except BaseException:
            if self.cfg.placement == "colocated":
                self._restore()
            raise

    def _restore(self) -> None:
        import ray
        ray.get(self.controller.resume_memory_occupation.remote(None))
        ray.get(self.controller.continue_generation.remote())

    def sync(self) -> dict:
        """Send the trained weights to every worker (one new version); returns the update's
        result (weight_version, phases). If the trainer or any worker fails, every worker
        keeps the old version and serves again (colocated: its weights come back from their
        spill), and the error is raised."""
        if self.cfg.placement == "colocated":
            try:
                return self._sync_colocated()
            except BaseException:
                self._restore()
                raise
        return self._sync_separate()

    def _sync_colocated(self) -> dict:
        import ray
        cfg = self.cfg
        # The weights stay released: the update replaces every one of them, so their
        # spilled bytes are never read back (only the rotary tables are). Decode graphs
        # (CUDA) come back with the KV pool; they are captured again at the next decode.
        t0 = time.perf_counter()
        _check(ray.get(self.controller.resume_memory_occupation.remote(
            ["kv_cache", "cuda_graph"])), "resume_memory_occupation")
        t1 = time.perf_counter()
        handle = ray.get(self.trainer.write_shared.remote())
        payload = None
        if self._workers_off_node(handle.node_ip):  # they cannot map the trainer's file
            payload = ray.get(self.trainer.put_payload.remote())
        t2 = time.perf_counter()
        result = ray.get(self.controller.update_weights.remote(
            TensorWeights(shared=handle, payload=payload), None, cfg.pause_mode))
        result["phases"] = {"resume_memory": t1 - t0, "trainer_write": t2 - t1,
                            **result["phases"]}
        return result

    def _workers_off_node(self, node_ip: str | None) -> list[str]:
        """The live workers on another node than ``node_ip`` (logged the first time)."""
        import ray
        state = ray.get(self.controller.fleet_state.remote())
        off = [w["worker_id"] for w in state["workers"]
               if w["state"] in ("ready", "draining") and node_ip and w["node_ip"] != node_ip]
        if off and not self._told_off_node:
            self._told_off_node = True
            logger.info("workers %s are not on the trainer's node (%s): they take the weights "
                        "through the object store instead of its shared-memory file", off,
                        node_ip)
        return off

    def _sync_separate(self) -> dict:
        import ray
        names, dtypes, shapes = self.spec
        source = DistributedWeights(names, dtypes, shapes)
        update = self.controller.update_weights.remote(source, None, self.cfg.pause_mode)
        try:
            ray.get(self.trainer.broadcast.remote())
        except BaseException:
            try:  # the workers' receives fail too; wait for them to roll back
                ray.get(update)
            except Exception as exc:  # noqa: BLE001 - the trainer's error is the one to raise
                logger.info("the fleet's update failed with the trainer's: %s", exc)
            raise
        return ray.get(update)

    def evaluate(self, problems) -> float:
        """Mean reward of one greedy answer per problem."""
        answers = self.answers(problems)
        return sum(a["reward"] for a in answers) / len(answers) if answers else float("nan")

    def answers(self, problems) -> list[dict]:
        """One greedy answer per problem: its prompt, the expected answer, the model's text
        (a tool episode's turns) and its reward."""
        if not problems:
            return []
        groups = self.rollout(problems, 1, None, {"temperature": 0.0,
                                                  "return_routed_experts": False})
        return [{"prompt": g.problem.prompt, "expected": g.problem.answer,
                 "text": g.samples[0].text, "reward": self.reward(g.samples[0].text, g.problem)}
                for g in groups]

    def close(self) -> None:
        import ray
        self._heartbeats.set()
        try:
            if self.cfg.placement == "separate":  # the workers may join another job's group
                ray.get(self.controller.destroy_weights_update_group.remote())
            ray.get(self.trainer.close.remote())
            ray.kill(self.trainer)
            if self.owns_fleet:  # the fleet this job started goes with it, controller included
                ray.get(self.controller.stop_fleet.remote())
                ray.kill(self.controller)
            self.placement.remove()
        except Exception:  # noqa: BLE001 - closing must not hide the run's own error
            logger.exception("closing the GRPO job's actors failed")
