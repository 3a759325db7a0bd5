"""The controller's operations on a running fleet: admin (drain, resume, flush, policy),
fleet-wide fan-outs (pause, memory, KV checks), views (health, state, metrics) and the RL
control plane's weight updates (actors/weight_rollout.py).

The fleet-wide control verbs implement :class:`~radixray.cluster.fleet_control.FleetControl`
(tests/cpu/test_control_surface.py checks the names and parameters): each asks every live
worker's engine verb and reports by worker id.

A mixin of :class:`~radixray.actors.controller.Controller`, which owns the state these
methods read: ``registry``, ``router``, ``weights``, ``adapters``, ``pd``, ``draining``,
``policy``, ``scaler`` (None for a fixed fleet),
and ``_publish`` / ``_checkpoint`` to tell the router and the checkpoint of a change.
Methods that read the registry wait for a restarted controller's rebuild first.
"""

from __future__ import annotations

import asyncio
import logging
import time

from radixray.actors.lifecycle import after_rebuild
from radixray.cluster.autoscaling_metrics import fixed_fleet_families
from radixray.cluster.errors import WorkerUnavailable, unwrap_ray_error
from radixray.cluster.messages import FleetHealth, WorkerEntry
from radixray.cluster.metrics import controller_families
from radixray.cluster.weight_sources import DiskWeights, WeightSource
from radixray.engine.messages import DEFAULT_GROUP

logger = logging.getLogger("radixray.controller")


class FleetOperations:
    # ---- operations -----------------------------------------------------------------
    @after_rebuild
    async def worker(self, worker_id: str) -> WorkerEntry:
        """The handle of a worker that takes requests; WorkerUnavailable otherwise."""
        rec = self.registry.get(worker_id)
        if rec.state not in ("ready", "draining"):
            raise WorkerUnavailable(f"engine worker {worker_id} is {rec.state}")
        return WorkerEntry(worker_id, rec.handle, rec.generation, rec.state)

    @after_rebuild
    async def live_workers(self) -> list[WorkerEntry]:
        return [await self.worker(r.worker_id) for r in self.registry.live()]

    @after_rebuild
    async def health(self) -> FleetHealth:
        """Whether the fleet takes requests, and why each worker that does not serve went
        down (its last death or engine failure)."""
        live = self.registry.live()
        return FleetHealth(self.draining, len(self.registry.routable()), self.registry.counts(),
                           {r.worker_id: r.error for r in self.registry
                            if r not in live and r.error},
                           self.pd.status(self.registry) if self.cfg.fleet.disaggregated else None)

    @after_rebuild
    async def drain_worker(self, worker_id: str) -> dict:
        """Stop sending new requests to ``worker_id``; its in-flight requests finish."""
        rec = self.registry.get(worker_id)
        if rec.state not in ("ready", "draining"):
            raise ValueError(f"worker {worker_id} is {rec.state}; only a ready worker drains")
        rec.set_state("draining")
        await self._publish()
        inflight = await rec.handle.drain.remote()
        logger.info("worker %s draining: %d request(s) in flight", worker_id, inflight)
        return {"worker_id": worker_id, "state": rec.state, "inflight": inflight}

    @after_rebuild
    async def resume_worker(self, worker_id: str) -> dict:
        rec = self.registry.get(worker_id)
        if worker_id in self.weights.stale:
            raise ValueError(f"worker {worker_id} serves weight version {rec.weight_version}, the "
                             f"fleet {self.weights.version}: the next weight update resumes it")
        if rec.state != "draining" or self.draining:
            raise ValueError(f"worker {worker_id} is {rec.state}"
                             + (" and the fleet is draining" if self.draining else "")
                             + "; only a draining worker of a serving fleet resumes")
        await rec.handle.resume.remote()
        rec.set_state("ready")
        await self._publish()
        return {"worker_id": worker_id, "state": rec.state}

    @after_rebuild
    async def drain_all(self) -> int:
        """Drain the whole fleet (shutdown); return the requests still in flight."""
        self.draining = True
        for rec in self.registry.in_state("ready"):
            rec.set_state("draining")
        await self._publish()
        results = await asyncio.gather(*(r.handle.drain.remote() for r in self.registry.live()),
                                       return_exceptions=True)
        return sum(n for n in results if isinstance(n, int))

    @after_rebuild
    async def num_inflight(self) -> int:
        results = await asyncio.gather(
            *(r.handle.inflight_rids.remote() for r in self.registry.live()),
            return_exceptions=True)
        return sum(len(x) for x in results if isinstance(x, list))

    @after_rebuild
    async def inflight_rids(self) -> dict[str, list[str]]:
        live = self.registry.live()
        results = await asyncio.gather(*(r.handle.inflight_rids.remote() for r in live),
                                       return_exceptions=True)
        return {r.worker_id: x for r, x in zip(live, results) if isinstance(x, list) and x}

    @after_rebuild
    async def _on_each_live(self, call) -> dict:
        """``call(handle)`` on every live worker: the result (or the error) by worker id."""
        live = self.registry.live()
        results = await asyncio.gather(*(call(r.handle) for r in live), return_exceptions=True)
        return {r.worker_id: (x if not isinstance(x, BaseException)
                              else {"error": str(unwrap_ray_error(x))})
                for r, x in zip(live, results)}

    @after_rebuild
    async def flush_cache(self) -> dict[str, bool]:
        """Flush every live worker's radix cache; when all did, the router forgets its
        prefix tree too (it would otherwise route to caches that no longer exist)."""
        results = await self._on_each_live(lambda h: h.flush_cache.remote())
        if self.router is not None and all(ok is True for ok in results.values()):
            await self.router.forget_prefixes.remote()
        return results

    async def pause_generation(self, mode: str) -> dict:
        """Pause every live worker in ``mode``: requests touched, by worker id."""
        return await self._on_each_live(lambda h: h.pause_generation.remote(mode))

    async def continue_generation(self) -> dict:
        """Let every live worker schedule again: whether it was paused, by worker id."""
        return await self._on_each_live(lambda h: h.continue_generation.remote())

    async def rebalance_experts(self) -> dict:
        """Every live worker rebalances its expert copies (EPLB): its report, or an error
        entry (EPLB off, weights released, a session that outlasts the wait)."""
        return await self._on_each_live(lambda h: h.rebalance_experts.remote())

    async def check_kv_conservation(self) -> dict:
        """Every live worker's KV slot check (an error entry if its invariant broke)."""
        return await self._on_each_live(lambda h: h.check_kv_conservation.remote())

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> dict:
        """Abort ``rid`` (and its derived choice ids) or every request on every live worker:
        a prefill-decode request's two halves share its id, and each rank of an expert-parallel
        group is a worker of its own, so each is reached. The ids aborted, by worker id."""
        return await self._on_each_live(lambda h: h.abort_request.remote(rid, abort_all))

    @after_rebuild
    async def set_policy(self, policy: str) -> dict:
        await self.router.set_policy.remote(policy)
        self.policy = policy
        self._checkpoint()
        return {"policy": policy}

    @after_rebuild
    async def fleet_state(self) -> dict:
        """The admin view: every worker's record plus the router's state."""
        router = await self.router.state.remote() if self.router is not None else None
        out = {"app": self.cfg.app_name, "draining": self.draining, "ep_size": self.ep_size,
               "controller": {"restarted": self.restarted, "started_at": self._started_at,
                              "policy": self.policy},
               "workers": [r.as_json() for r in self.registry], "router": router}
        if self.cfg.fleet.disaggregated:
            out["disaggregation"] = self.pd.status(self.registry)
        if self.scaler is not None:
            out["autoscaling"] = self.scaler.state()
        return out

    @after_rebuild
    async def metric_families(self) -> list[list]:
        """Prometheus families of every live worker, the router, the controller and the
        ingress replicas that still beat."""
        live = self.registry.live()
        results = await asyncio.gather(*(r.handle.metric_families.remote() for r in live),
                                       return_exceptions=True)
        out = [x for x in results if not isinstance(x, BaseException)]
        if self.router is not None:
            out.append(await self.router.metric_families.remote())
        if self.scaler is not None:
            scaling = self.scaler.metrics.families()
        else:
            scaling = fixed_fleet_families({role: len([r for r in self.registry.in_state(
                "starting", "ready") if r.role == role]) for role in self.cfg.fleet.role_counts()})
        out.append(controller_families(self.registry) + self.weights.metrics.families()
                   + scaling)
        stale = time.monotonic() - self.cfg.fleet.owner_timeout_s
        for owner in [o for o in self._owner_families if self._owners.get(o, 0) < stale]:
            del self._owner_families[owner]  # a replica gone: its series go with it
        out.extend(self._owner_families.values())
        return out

    # ---- RL control plane (actors/weight_rollout.py) ------------------------------------
    async def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """Release ``tags`` on every live worker (each must be paused): results by worker."""
        return await self._on_each_live(lambda h: h.release_memory_occupation.remote(tags))

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return await self._on_each_live(lambda h: h.resume_memory_occupation.remote(tags))

    async def get_weight_version(self) -> dict:
        """The fleet's version (of its last update) and each live worker's own."""
        versions = await self._on_each_live(lambda h: h.get_weight_version.remote())
        return {"weight_version": self.weights.version, "workers": versions}

    @after_rebuild
    async def update_weight_version(self, new_version: int | str) -> dict:
        """Rename the weights every live worker serves (no transfer; see
        FleetWeights.relabel): ``{"weight_version", "previous_version", "workers"}``."""
        result = await self.weights.relabel(self.registry.live(), new_version)
        await self._publish()
        return result

    @after_rebuild
    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """Serve the adapter on every live worker, all or none (actors/fleet_lora.py)."""
        try:
            return await self.adapters.load(self.registry.live(), lora_name, lora_path)
        finally:
            self._checkpoint()

    @after_rebuild
    async def unload_lora_adapter(self, lora_name: str) -> dict:
        try:
            return await self.adapters.unload(self.registry.live(), lora_name)
        finally:
            self._checkpoint()

    async def update_lora_adapter(self, lora_name: str, lora_path: str,
                                  lora_version: int | str | None = None) -> dict:
        """Every live worker or none serves the adapter's weights from ``lora_path`` (a PEFT
        folder, or a .safetensors file of some of its tensors) as ``lora_version`` (None: the
        adapter's next int), committed between steps without a pause: ``update_weights``
        with a disk source for the adapter."""
        return await self.update_weights(DiskWeights(lora_path, lora_name=lora_name),
                                         lora_version, pause_mode=None)

    async def _catch_up(self, rec, weight_version) -> str | None:
        """Bring a just-started worker (serving ``weight_version``) to the fleet's weight
        version and adapter versions; None when it serves them, else why it cannot (it stays
        out of routing: FleetWeights.catch_up)."""
        behind = None
        if weight_version != self.weights.version:
            behind = await self.weights.catch_up(rec)
        else:
            self.weights.stale.discard(rec.worker_id)
        if self.adapters.updates and not behind:
            async with self.weights.lock:
                await self.adapters.catch_up(rec)
        return behind

    async def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters the fleet serves: name -> path."""
        return dict(self.adapters.adapters)

    @after_rebuild
    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        world_size: int, group_name: str = DEFAULT_GROUP,
                                        backend: str = "gloo", timeout_s: float = 600.0) -> dict:
        """Every live worker joins the trainer's group (rank 1, 2, ... in worker order; the
        trainer is rank 0 and joins at the same time). Returns the ranks by worker."""
        live = self.registry.live()
        if world_size != len(live) + 1:
            raise ValueError(f"world_size must be 1 (the trainer) + {len(live)} live workers = "
                             f"{len(live) + 1}, got {world_size}")
        ranks = {r.worker_id: i + 1 for i, r in enumerate(live)}
        await asyncio.gather(*(r.handle.init_weights_update_group.remote(
            master_address, master_port, ranks[r.worker_id], world_size, group_name, backend,
            timeout_s) for r in live))
        return {"group_name": group_name, "world_size": world_size, "ranks": ranks}

    @after_rebuild
    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> dict:
        """Every live worker leaves ``group_name``; worker -> whether it was in it."""
        live = self.registry.live()
        left = await asyncio.gather(*(r.handle.destroy_weights_update_group.remote(group_name)
                                      for r in live))
        return dict(zip((r.worker_id for r in live), left))

    @after_rebuild
    async def update_weights(self, source: WeightSource,
                             weight_version: int | str | None = None,
                             pause_mode: str | None = "retract",
                             release_memory: list[str] = (), keep_paused: bool = False) -> dict:
        """One weight update on every live worker, all or none (see weight_rollout.py).
        ``source``: a cluster/weight_sources.py type (disk, tensor, distributed). The version
        is an int or a string label (engine/weights/version.py); it defaults to the next
        integer, and a refused one raises VersionRefused with nothing started. Workers left
        stale by a restart take requests again afterwards. A source's ``lora_name``: that
        LoRA adapter's update instead, under its own version (actors/fleet_lora.py); the
        base weights, their version and the stale workers stay as they are."""
        if getattr(source, "lora_name", None) is not None:  # else FleetWeights checks its type
            try:
                return await self.adapters.update(self.registry.live(), source, weight_version,
                                                  pause_mode, list(release_memory), keep_paused,
                                                  self.weights.lock, self.weights.metrics)
            finally:
                self._checkpoint()
        result = await self.weights.update(self.registry.live(), source, weight_version,
                                           pause_mode, list(release_memory), keep_paused)
        for rec in self.registry.live():
            if rec.worker_id in self.weights.stale:
                self.weights.stale.discard(rec.worker_id)
                if not self.draining and rec.state == "draining":
                    await rec.handle.resume.remote()
                    rec.set_state("ready")
                    rec.error = None
        await self._publish()
        return result
