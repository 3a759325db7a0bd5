"""Controller: the one actor that knows the whole fleet.

It starts the engine workers (one placement-group bundle each), keeps the
registry (:mod:`radixray.cluster.registry`), pings every live worker, restarts a
worker whose actor died or whose engine failed (its scheduler gave up after
repeated faults, or its thread died) and re-registers it, drains and resumes workers on
request, and tells the router which workers are routable after every change.
Only the controller starts or stops workers; ingress replicas ask it for worker
handles and route through the router actor it creates.

It is a named, detached async actor (``{app}-controller-{fleet key}``), created
by the first ingress replica that needs it; the workers and the router are its
children. Every ingress replica sends it a heartbeat; once none has for
``fleet.owner_timeout_s`` (the app was deleted, or redeployed with a different
fleet shape) it stops the workers and the router and exits. So no single
replica's death takes the fleet down, and no fleet outlives its app.
"""

from __future__ import annotations

import asyncio
import logging
import time

from radixray.actors.weight_rollout import FleetWeights
from radixray.cluster.config import ServeConfig
from radixray.cluster.errors import WorkerUnavailable, unwrap_ray_error
from radixray.cluster.messages import FleetHealth, WorkerEntry, WorkerInfo
from radixray.cluster.metrics import controller_families
from radixray.cluster.pd_bootstrap import PDBootstrapService
from radixray.cluster.registry import Registry, WorkerRecord
from radixray.engine.messages import DEFAULT_GROUP

logger = logging.getLogger("radixray.controller")

LOAD_TIMEOUT_S = 30.0  # load() waits for a scheduler step; a long prefill step can take seconds


class Controller:
    def __init__(self, config: dict):
        self.cfg = ServeConfig.parse(config)
        logging.basicConfig(level=self.cfg.server.log_level.upper(),
                            format="[%(asctime)s] %(message)s", datefmt="%Y-%m-%d %H:%M:%S")
        self.registry = Registry()
        self.draining = False
        self.router = None
        self.placement_group = None
        self._owns_placement_group = True
        self._first_bundle = 0  # of the workers in the placement group
        self._info: WorkerInfo | None = None
        self._start_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._owners: dict[str, float] = {}  # ingress replica -> last heartbeat (monotonic)
        self._owner_families: dict[str, list] = {}  # ingress replica -> its HTTP series
        self._created = time.monotonic()
        self._watchdog: asyncio.Task | None = None
        self.weights = FleetWeights()  # the fleet's weight version and its updates
        self.pd = PDBootstrapService()  # prefill-decode endpoints and handshake

    # ---- start-up -------------------------------------------------------------------
    async def start(self) -> WorkerInfo:
        """Start the fleet once (later calls wait for the first); return worker-0's info
        (model, context length, vocabulary) for the ingress."""
        self._ensure_watchdog()
        if self._start_task is None:
            self._start_task = asyncio.create_task(self._start())
        await asyncio.shield(self._start_task)
        return self._info

    async def _start(self) -> None:
        from radixray.actors.router import router_actor_class
        fleet = self.cfg.fleet
        t0 = time.perf_counter()
        bundle = self.cfg.worker_bundle()
        if bundle and self.placement_group is None:
            from ray.util import placement_group
            self.placement_group = placement_group([dict(bundle)] * fleet.total_workers,
                                                   strategy=fleet.placement_strategy,
                                                   name=f"{self.cfg.app_name}-workers")
            await self.placement_group.ready()
        self.router = router_actor_class().options(
            name=self.cfg.router_name(), namespace=self.cfg.namespace, get_if_exists=True,
            num_cpus=0, max_concurrency=1000).remote(self.cfg.router.settings())
        records = [self.registry.add(i, role) for i, role in enumerate(fleet.roles())]
        for rec in records:
            self._launch(rec)
        await asyncio.gather(*(self._await_ready(rec) for rec in records))
        ready = [r for r in records if r.state == "ready"]
        if not ready:
            raise RuntimeError("no engine worker started: "
                               + "; ".join(f"{r.worker_id}: {r.error}" for r in records))
        self._info = await ready[0].handle.info.remote()
        if fleet.disaggregated:
            await self.pd.handshake(self.registry)
        logger.info("fleet ready in %.1f s: %d/%d workers, policy %s, placement %s %s",
                    time.perf_counter() - t0, len(ready), len(records), self.cfg.router.policy,
                    fleet.placement_strategy, bundle or "(no bundle)")
        self._spawn(self._health_loop())
        await self._publish()

    def adopt_placement_group(self, group, first_bundle: int) -> None:
        """Start the workers in bundles ``first_bundle ..`` of ``group`` (a GRPO job's, which
        also holds its trainer) instead of a group of the fleet's own; call before
        :meth:`start`. The group stays its owner's when the fleet stops."""
        if self._start_task is not None:
            raise RuntimeError("adopt_placement_group must come before start()")
        self.placement_group, self._first_bundle = group, first_bundle
        self._owns_placement_group = False

    def _launch(self, rec: WorkerRecord) -> None:
        """Create the worker actor for ``rec`` in its bundle (returns at once)."""
        from radixray.actors.engine_worker import worker_actor_class
        s = self.cfg.server
        options = dict(num_cpus=s.worker_num_cpus, num_gpus=s.worker_num_gpus,
                       max_concurrency=1000)
        if self.placement_group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=self._first_bundle + rec.index)
        import ray
        rec.handle = worker_actor_class().options(**options).remote(
            self.cfg.engine_options_for(rec.role), rec.worker_id, s.warmup, s.log_level,
            cores_shared_by=self._workers_per_node(), niceness=s.worker_niceness,
            fleet=ray.get_runtime_context().current_actor if rec.role != "unified" else None,
            compute_nice_offset=s.pd_compute_nice_offset, slo=(s.slo_ttft_s, s.slo_tpot_s),
            max_queued_requests=s.max_queued_requests, retry_after_s=s.queue_full_retry_after_s)
        rec.set_state("starting")
        rec.weight_version = 0
        rec.started_at = time.time()
        rec.ready_at = None

    def _workers_per_node(self) -> int:
        # PACK puts every bundle on one node when it fits (the local and single-node case);
        # SPREAD strategies put one per node.
        return 1 if "SPREAD" in self.cfg.fleet.placement_strategy else \
            self.cfg.fleet.total_workers

    async def _await_ready(self, rec: WorkerRecord) -> None:
        """Wait for the worker's constructor (model load + warm-up); record the outcome."""
        try:
            info = await rec.handle.info.remote()
        except Exception as exc:  # noqa: BLE001 - any start-up failure marks the slot dead
            self._mark_dead(rec, f"start-up failed: {unwrap_ray_error(exc)}")
            return
        rec.kv_session, rec.kv_layout = info.kv_session, info.kv_layout
        behind = await self.weights.catch_up(rec)
        if behind:
            rec.error = behind
            logger.warning("worker %s stays out of routing: %s", rec.worker_id, behind)
        rec.set_state("draining" if self.draining or behind else "ready")
        rec.healthy, rec.last_ping_at = True, time.time()
        self._spawn(self._watch(rec, rec.generation))
        if self.draining or behind:
            await rec.handle.drain.remote()
        logger.info("worker %s ready (generation %d, pool %d tokens)", rec.worker_id,
                    rec.generation, info.max_total_tokens)

    # ---- ownership --------------------------------------------------------------------
    async def heartbeat(self, owner: str, families: list | None = None) -> None:
        """Ingress replica ``owner`` is alive and uses this fleet; ``families``: its own
        Prometheus series (HTTP latency), served with the fleet's until it stops beating."""
        self._owners[owner] = time.monotonic()
        if families is not None:
            self._owner_families[owner] = families
        self._ensure_watchdog()

    def _ensure_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch_owners())

    async def _watch_owners(self) -> None:
        timeout = self.cfg.fleet.owner_timeout_s
        while True:
            await asyncio.sleep(min(timeout / 4, 5.0))
            last = max(self._owners.values(), default=self._created)
            if time.monotonic() - last > timeout:
                logger.warning("no ingress replica of app %r for %.0f s: stopping the fleet",
                               self.cfg.app_name, timeout)
                await self.stop_fleet()
                import ray
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                return

    async def stop_fleet(self) -> None:
        """Kill every worker and the router, release the placement group."""
        import ray
        for task in list(self._tasks):
            task.cancel()
        handles = [r.handle for r in self.registry if r.handle is not None] + [self.router]
        for handle in handles:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for rec in self.registry:
            rec.set_state("failed")
            rec.error = "fleet stopped"
        if self.placement_group is not None and self._owns_placement_group:
            from ray.util import remove_placement_group
            remove_placement_group(self.placement_group)
        self.placement_group = None

    # ---- health ---------------------------------------------------------------------
    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _health_loop(self) -> None:
        interval = self.cfg.fleet.health_check_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                await self.check_health()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad round
                logger.exception("health check round failed")

    async def check_health(self) -> None:
        """Ping every live worker once; restart the dead ones; refresh loads."""
        live = self.registry.live()
        results = await asyncio.gather(*(self._ping(r) for r in live))
        changed = False
        for rec, alive in zip(live, results):
            if not alive:
                changed = True
                self._spawn(self._replace(rec))
        for rec in self.registry.in_state("dead"):
            if rec not in live:  # died during start-up
                changed = True
                self._spawn(self._replace(rec))
        if changed or (self.cfg.fleet.disaggregated and not self.pd.ready_in(self.registry)):
            await self._publish()  # a disaggregated fleet also retries its handshake
        await asyncio.gather(*(self._refresh_load(r) for r in self.registry.live()))

    async def _watch(self, rec: WorkerRecord, generation: int) -> None:
        """Keep one ``wait_until_failed`` call open on a ready worker: it returns when the
        engine fails and raises when the actor dies, so either is replaced at once rather
        than at the next ping."""
        try:
            error = f"failed: {await rec.handle.wait_until_failed.remote()}"
        except Exception as exc:  # noqa: BLE001 - RayActorError and friends: the actor is gone
            error = f"died: {unwrap_ray_error(exc)}"
        if rec.generation != generation or rec not in self.registry.live():
            return  # already replaced, or stopped on purpose
        self._mark_dead(rec, error)
        await self._publish()
        await self._replace(rec)

    def _mark_dead(self, rec: WorkerRecord, error: str) -> None:
        rec.error = error
        rec.set_state("dead")
        logger.error("worker %s (generation %d) %s", rec.worker_id, rec.generation, error)

    async def _ping(self, rec: WorkerRecord) -> bool:
        """False when the actor is gone or its engine failed (then ``rec`` is marked dead)."""
        try:
            health = await asyncio.wait_for(rec.handle.ping.remote(),
                                            self.cfg.fleet.health_check_timeout_s)
        except asyncio.TimeoutError:
            if rec.healthy:
                logger.warning("worker %s did not answer a ping within %.0f s", rec.worker_id,
                               self.cfg.fleet.health_check_timeout_s)
            rec.healthy = False
            return True
        except Exception as exc:  # noqa: BLE001 - RayActorError and friends: the actor is gone
            self._mark_dead(rec, f"died: {unwrap_ray_error(exc)}")
            return False
        if not health.ok:
            self._mark_dead(rec, f"failed: {health.reason}")
            return False
        rec.healthy, rec.last_ping_at = True, time.time()
        return True

    async def _refresh_load(self, rec: WorkerRecord) -> None:
        try:
            rec.load = await asyncio.wait_for(rec.handle.load.remote(), LOAD_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a missing load figure is not a health verdict
            pass

    async def _replace(self, rec: WorkerRecord) -> None:
        """Start a new actor in a dead worker's slot, or give up on it."""
        import ray
        if rec.state != "dead":
            return
        fleet = self.cfg.fleet
        try:  # a failed engine's actor still runs: it holds memory and a bundle
            ray.kill(rec.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        if not fleet.restart_dead_workers or rec.restarts >= fleet.max_restarts:
            rec.set_state("failed")
            logger.error("worker %s stays down (restarts %d, limit %d, restarts %s)",
                         rec.worker_id, rec.restarts, fleet.max_restarts,
                         "on" if fleet.restart_dead_workers else "off")
            await self._publish()
            return
        rec.restarts += 1
        rec.generation += 1
        logger.warning("restarting worker %s (restart %d)", rec.worker_id, rec.restarts)
        self._launch(rec)
        await self._await_ready(rec)
        await self._publish()

    async def _publish(self) -> None:
        """Tell the router which workers take new requests (and their roles), and their
        weight versions; a disaggregated fleet that lost its handshake tries again."""
        if self.cfg.fleet.disaggregated and self._info is not None:
            await self.pd.handshake(self.registry)
        if self.router is not None:
            await self.router.set_workers.remote(
                self.registry.routable(), {r.worker_id: r.role for r in self.registry})
            await self.router.set_weight_versions.remote(
                {r.worker_id: r.weight_version for r in self.registry.live()})

    # ---- operations -----------------------------------------------------------------
    async def worker(self, worker_id: str) -> WorkerEntry:
        """The handle of a worker that takes requests; WorkerUnavailable otherwise."""
        rec = self.registry.get(worker_id)
        if rec.state not in ("ready", "draining"):
            raise WorkerUnavailable(f"engine worker {worker_id} is {rec.state}")
        return WorkerEntry(worker_id, rec.handle, rec.generation, rec.state)

    async def live_workers(self) -> list[WorkerEntry]:
        return [await self.worker(r.worker_id) for r in self.registry.live()]

    async def health(self) -> FleetHealth:
        """Whether the fleet takes requests, and why each worker that does not serve went
        down (its last death or engine failure)."""
        live = self.registry.live()
        return FleetHealth(self.draining, len(self.registry.routable()), self.registry.counts(),
                           {r.worker_id: r.error for r in self.registry
                            if r not in live and r.error},
                           self.pd.status(self.registry) if self.cfg.fleet.disaggregated else None)

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

    async def drain_all(self) -> int:
        """Drain the whole fleet (shutdown); return the requests still in flight."""
        self.draining = True
        for rec in self.registry.in_state("ready"):
            rec.set_state("draining")
        await self._publish()
        results = await asyncio.gather(*(r.handle.drain.remote() for r in self.registry.live()),
                                       return_exceptions=True)
        return sum(n for n in results if isinstance(n, int))

    async def num_inflight(self) -> int:
        results = await asyncio.gather(
            *(r.handle.inflight_rids.remote() for r in self.registry.live()),
            return_exceptions=True)
        return sum(len(x) for x in results if isinstance(x, list))

    async def inflight_rids(self) -> dict[str, list[str]]:
        live = self.registry.live()
        results = await asyncio.gather(*(r.handle.inflight_rids.remote() for r in live),
                                       return_exceptions=True)
        return {r.worker_id: x for r, x in zip(live, results) if isinstance(x, list) and x}

    async def _on_each_live(self, call) -> dict:
        """``call(handle)`` on every live worker: the result (or the error) by worker id."""
        live = self.registry.live()
        results = await asyncio.gather(*(call(r.handle) for r in live), return_exceptions=True)
        return {r.worker_id: (x if not isinstance(x, BaseException)
                              else {"error": str(unwrap_ray_error(x))})
                for r, x in zip(live, results)}

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

    async def check_kv_conservation(self) -> dict:
        """Every live worker's KV slot check (an error entry if its invariant broke)."""
        return await self._on_each_live(lambda h: h.check_kv_conservation.remote())

    async def set_policy(self, policy: str) -> dict:
        await self.router.set_policy.remote(policy)
        return {"policy": policy}

    async def fleet_state(self) -> dict:
        """The admin view: every worker's record plus the router's state."""
        router = await self.router.state.remote() if self.router is not None else None
        out = {"app": self.cfg.app_name, "draining": self.draining,
               "workers": [r.as_json() for r in self.registry], "router": router}
        if self.cfg.fleet.disaggregated:
            out["disaggregation"] = self.pd.status(self.registry)
        return out

    async def metric_families(self) -> list[list]:
        """Prometheus families of every live worker, the router, the controller and the
        ingress replicas that still beat."""
        live = self.registry.live()
        results = await asyncio.gather(*(r.handle.metric_families.remote() for r in live),
                                       return_exceptions=True)
        out = [x for x in results if not isinstance(x, BaseException)]
        if self.router is not None:
            out.append(await self.router.metric_families.remote())
        out.append(controller_families(self.registry) + self.weights.metrics.families())
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

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> dict:
        """Every live worker leaves ``group_name``; worker -> whether it was in it."""
        live = self.registry.live()
        left = await asyncio.gather(*(r.handle.destroy_weights_update_group.remote(group_name)
                                      for r in live))
        return dict(zip((r.worker_id for r in live), left))

    async def update_weights(self, source: dict, weight_version: int | None = None,
                             pause_mode: str | None = "retract",
                             release_memory: list[str] = (), keep_paused: bool = False) -> dict:
        """One weight update on every live worker, all or none (see weight_rollout.py).
        ``source``: WeightSource fields (``kind`` disk | tensor | distributed). The version
        defaults to the fleet's current one + 1. Workers left stale by a restart take
        requests again afterwards."""
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


def controller_actor_class():
    import ray
    return ray.remote(Controller)
