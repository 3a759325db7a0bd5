"""Controller: the one actor that knows the whole fleet.

It starts the engine workers (one placement-group bundle each), keeps the
registry (:mod:`radixray.cluster.registry`), pings every live worker, restarts a
worker whose actor died or whose engine failed (its scheduler gave up after
repeated faults, or its thread died) and re-registers it, drains and resumes workers on
request, and tells the router which workers are routable after every change.
Only the controller starts or stops workers; ingress replicas ask it for worker
handles and route through the router actor it creates.

It is a named, detached async actor (``{app}-controller-{fleet key}``), created by the
first ingress replica that needs it or, earlier, by ``radixray serve`` (serve/fleet.py
``prestart_fleet``); the workers and the router are its children. Every ingress replica
sends it a heartbeat; once none has for ``fleet.owner_timeout_s`` (the app was deleted,
or redeployed with a different fleet shape) it stops the workers and the router and
exits. So no replica's death takes the fleet down, and no fleet outlives its app.

The controller is restartable too. The workers and the router are named, detached
actors, so they keep serving while it is down; when Ray starts it again (same
constructor arguments), it finds them by name, reads back from each worker its role,
incarnation, draining flag and weight version, restores what only it knew from its
checkpoint (actors/fleet_checkpoint.py), starts any worker that is missing, and
publishes the workers to the router again. Ingress replicas keep their channels open
throughout; only calls to the controller itself wait or fail while it restarts.
"""

from __future__ import annotations

import asyncio
import logging
import time

from radixray.actors import fleet_checkpoint
from radixray.actors.fleet_checkpoint import FleetCheckpoint
from radixray.actors.fleet_lora import FleetAdapters
from radixray.actors.fleet_ops import FleetOperations
from radixray.actors.fleet_scaler import FleetScaler
from radixray.actors.lifecycle import every, reconstructed
from radixray.actors.placement import (
    in_bundle,
    own_group,
    remove_group,
    rendezvous,
    slot_placement,
    workers_per_node,
)
from radixray.actors.weight_rollout import FleetWeights
from radixray.cluster.config import ServeConfig
from radixray.cluster.errors import actor_unreachable, unwrap_ray_error
from radixray.cluster.messages import WorkerInfo
from radixray.cluster.pd_bootstrap import PDBootstrapService
from radixray.cluster.registry import Registry, WorkerRecord

logger = logging.getLogger("radixray.controller")

LOAD_TIMEOUT_S = 30.0  # load() waits for a scheduler step; a long prefill step can take seconds
NAME_RELEASE_S = 30.0  # a killed worker's actor name is free again within this


class Controller(FleetOperations):
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
        self._started_at = time.time()
        self._watchdog: asyncio.Task | None = None
        self.weights = FleetWeights()  # the fleet's weight version and its updates
        self.pd = PDBootstrapService()  # prefill-decode endpoints and handshake
        # the LoRA adapters every worker serves (actors/fleet_lora.py)
        self.adapters = FleetAdapters.from_engine_options(self.cfg.engine_options_for("unified"))
        self.policy = self.cfg.router.policy  # the routing policy, as set at run time
        self.restarted = reconstructed()
        self._group_locks: dict[int, asyncio.Lock] = {}  # one replacement per group at a time
        # autoscaled fleets: a placement group per worker, added and drained away on load
        self.scaler = FleetScaler(self) if self.cfg.fleet.autoscaling is not None else None
        if self.restarted:  # Ray restarted this actor: rebuild the fleet from its actors now
            logger.warning("controller restarted: rebuilding the fleet %s from its running "
                           "actors", self.cfg.controller_name())
            self._ensure_watchdog()
            self._start_task = asyncio.get_running_loop().create_task(self._start())

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
        import ray

        from radixray.actors.router import router_actor_class
        fleet = self.cfg.fleet
        t0 = time.perf_counter()
        saved = fleet_checkpoint.load(self.cfg.controller_name())
        if saved is not None:
            self._restore(saved)
        bundles = self.cfg.worker_bundles()
        if bundles and self.placement_group is None:
            from ray.util import placement_group
            self.placement_group = placement_group(bundles,
                                                   strategy=fleet.placement_strategy,
                                                   name=f"{self.cfg.controller_name()}-workers",
                                                   lifetime="detached")
            await self.placement_group.ready()
        self.router = router_actor_class().options(
            name=self.cfg.router_name(), namespace=self.cfg.namespace, get_if_exists=True,
            num_cpus=0, max_concurrency=1000, lifetime="detached",
            max_restarts=fleet.actor_max_restarts).remote(
                self.cfg.router.settings(), ray.get_runtime_context().current_actor,
                self._owner_name())
        if saved is not None and saved.layout:  # an autoscaled fleet's slots as they were
            records = [self.registry.add(i, role) for i, role, _ in sorted(saved.layout.values())]
            for rec, (_, _, group) in zip(records, sorted(saved.layout.values())):
                rec.placement_group = group
        else:
            records = [self.registry.add(i, role)
                       for i, role in enumerate(self.cfg.slot_roles())]
        if self.scaler is not None:
            self.scaler.adopt(records, getattr(saved, "retiring", frozenset()))
        adopted = 0
        for group in self._groups(records):
            for rec in group:
                if saved is not None:
                    rec.generation, rec.restarts = saved.slots.get(rec.worker_id, (0, 0))
                rec.handle = self._find_worker(rec)
            if all(rec.handle is not None for rec in group):
                adopted += len(group)
                for rec in group:
                    rec.set_state("starting")
                continue
            for rec in group:  # an expert-parallel group starts whole (a lone rank cannot join)
                self._kill(rec)
            await self._names_released(group)
            await self._launch_group(group)
        await asyncio.gather(*(self._await_ready(rec) for rec in records))
        ready = [r for r in records if r.state in ("ready", "draining")]
        if not ready:
            raise RuntimeError("no engine worker started: "
                               + "; ".join(f"{r.worker_id}: {r.error}" for r in records))
        self._info = await ready[0].handle.info.remote()
        if fleet.disaggregated:
            await self.pd.handshake(self.registry)
        logger.info("fleet ready in %.1f s: %d/%d workers (%d adopted running), policy %s, "
                    "placement %s %s", time.perf_counter() - t0, len(ready), len(records),
                    adopted, self.policy, fleet.placement_strategy,
                    bundles if any(bundles) else "(no bundle)")
        self._spawn(self._health_loop())
        if self.scaler is not None:
            self.scaler.resume_retiring(records)
            self._spawn(self.scaler.run())
        await self._publish()

    def _restore(self, saved: FleetCheckpoint) -> None:
        """Take back what only the controller knew (a restart, or a new controller of a
        fleet whose old one died without stopping it)."""
        self.placement_group, self._first_bundle = saved.placement_group, saved.first_bundle
        self._owns_placement_group = saved.owns_placement_group
        self.draining, self.policy = saved.draining, saved.policy or self.policy
        self.weights.restore(saved.weight_version, saved.replay, saved.stale,
                             saved.weight_version_floor)
        if saved.lora_adapters is not None:
            self.adapters = FleetAdapters(saved.lora_adapters, saved.lora_updates)
        logger.info("restored the fleet's checkpoint: weight version %r, draining %s, "
                    "policy %s", saved.weight_version, saved.draining, self.policy)

    def _checkpoint(self) -> None:
        fleet_checkpoint.save(self.cfg.controller_name(), FleetCheckpoint(
            self.placement_group, self._first_bundle, self._owns_placement_group, self.draining,
            *self.weights.saved(), self.policy,
            {r.worker_id: (r.generation, r.restarts) for r in self.registry},
            weight_version_floor=self.weights.floor, lora_adapters=dict(self.adapters.adapters),
            lora_updates=dict(self.adapters.updates),
            layout={r.worker_id: (r.index, r.role, r.placement_group) for r in self.registry}
            if self.scaler is not None else None,
            retiring=frozenset(r.worker_id for r in self.registry if r.retiring)))

    def _owner_name(self) -> tuple[str, str]:
        """(name, namespace) under which the fleet's actors find their controller."""
        return self.cfg.controller_name(), self.cfg.namespace

    def _find_worker(self, rec: WorkerRecord):
        """The running actor of ``rec``'s slot (kept through a controller restart), or None."""
        import ray
        try:
            return ray.get_actor(self.cfg.worker_name(rec.worker_id), namespace=self.cfg.namespace)
        except ValueError:
            return None

    async def _names_released(self, group: list[WorkerRecord]) -> None:
        """Wait until killed workers' actor names are free for their successors."""
        deadline = time.monotonic() + NAME_RELEASE_S
        while any(self._find_worker(r) is not None for r in group) and \
                time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    async def republish(self) -> None:
        """A restarted router asks for the routable workers (and the policy) again."""
        if self._start_task is not None and self._start_task.done():
            await self._publish()

    def adopt_placement_group(self, group, first_bundle: int) -> None:
        """Start the workers in bundles ``first_bundle ..`` of ``group`` (a GRPO job's, which
        also holds its trainer) instead of a group of the fleet's own; call before
        :meth:`start`. The group stays its owner's when the fleet stops."""
        if self._start_task is not None:
            raise RuntimeError("adopt_placement_group must come before start()")
        if self.scaler is not None:
            raise RuntimeError("an autoscaled fleet gives each worker a placement group of its "
                               "own; it cannot adopt one")
        self.placement_group, self._first_bundle = group, first_bundle
        self._owns_placement_group = False

    # ---- expert-parallel groups ---------------------------------------------------------
    @property
    def ep_size(self) -> int:
        """Ranks per expert-parallel group: consecutive worker slots (1: no EP)."""
        return self.cfg.engine.ep_size

    def _groups(self, records: list[WorkerRecord]) -> list[list[WorkerRecord]]:
        """``records`` (in slot order) cut into their expert-parallel groups."""
        ep = self.ep_size
        return [records[i:i + ep] for i in range(0, len(records), ep)]

    def _group_of(self, rec: WorkerRecord) -> list[WorkerRecord]:
        ep = self.ep_size
        return [r for r in self.registry if r.index // ep == rec.index // ep]

    async def _launch_group(self, group: list[WorkerRecord]) -> None:
        """Create the actors of one group (one worker without EP). The ranks of an EP group
        meet at a rendezvous address on the node of its first rank."""
        for rec in group:
            if self.scaler is not None:
                await own_group(self.cfg, rec)
        address = None
        if self.ep_size > 1:
            where, bundles = slot_placement(self.cfg, group[0], self.placement_group,
                                            self._first_bundle)
            address = await rendezvous(where, bundles[0])
        for rank, rec in enumerate(group):
            self._launch(rec, {"ep_rank": rank, "ep_init_method": address} if address else None)

    def _launch(self, rec: WorkerRecord, ep: dict | None = None) -> None:
        """Create the worker actor for ``rec`` in its bundle (returns at once); ``ep``: its
        rank and rendezvous in an expert-parallel group."""
        import ray

        from radixray.actors.engine_worker import worker_actor_class
        from radixray.actors.tp_ranks import TPPlacement
        s = self.cfg.server
        cpus, gpus = self.cfg.rank_resources()
        group, bundles = slot_placement(self.cfg, rec, self.placement_group, self._first_bundle)
        options = dict(num_cpus=cpus, num_gpus=gpus, max_concurrency=1000,
                       **in_bundle(group, bundles[0]))
        followers = TPPlacement(group, tuple(bundles[1:]) if group else (), cpus, gpus)
        rec.handle = worker_actor_class().options(
            name=self.cfg.worker_name(rec.worker_id), namespace=self.cfg.namespace,
            lifetime="detached", **options).remote(
            {**self.cfg.engine_options_for(rec.role), **self.adapters.engine_options(),
             **(ep or {})}, rec.worker_id, s.warmup,
            s.log_level,
            cores_shared_by=workers_per_node(self.cfg), niceness=s.worker_niceness,
            fleet=ray.get_runtime_context().current_actor,
            compute_nice_offset=s.pd_compute_nice_offset, slo=(s.slo_ttft_s, s.slo_tpot_s),
            max_queued_requests=s.max_queued_requests, retry_after_s=s.queue_full_retry_after_s,
            generation=rec.generation, owner=self._owner_name(),
            tp_ranks=followers if len(bundles) > 1 else None)
        rec.set_state("starting")
        rec.weight_version = 0
        rec.started_at = time.time()
        rec.ready_at = None

    async def _await_ready(self, rec: WorkerRecord) -> None:
        """Wait for the worker's constructor (model load + warm-up); record the outcome. A
        worker found running (a controller restart) keeps its draining flag and version."""
        try:
            info = await rec.handle.info.remote()
        except Exception as exc:  # noqa: BLE001 - any start-up failure marks the slot dead
            self._mark_dead(rec, f"start-up failed: {unwrap_ray_error(exc)}")
            return
        rec.kv_session, rec.kv_endpoint = info.kv_session, info.kv_endpoint
        rec.generation, rec.started_at, rec.pid = info.generation, info.started_at, info.pid
        rec.node_ip, rec.tp_ranks = info.node_ip, info.tp_ranks
        rec.weight_version = info.weight_version
        behind = await self._catch_up(rec, info.weight_version)
        if behind:
            rec.error = behind
            logger.warning("worker %s stays out of routing: %s", rec.worker_id, behind)
        drain = self.draining or behind or info.draining
        rec.set_state("draining" if drain else "ready")
        rec.healthy, rec.last_ping_at = True, time.time()
        self._spawn(self._watch(rec, rec.generation))
        if drain:
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
            remove_group(rec)
        if self.placement_group is not None and self._owns_placement_group:
            from ray.util import remove_placement_group
            remove_placement_group(self.placement_group)
        self.placement_group = None
        fleet_checkpoint.delete(self.cfg.controller_name())

    # ---- health ---------------------------------------------------------------------
    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _health_loop(self) -> None:
        await every(self.cfg.fleet.health_check_interval_s, self.check_health,
                    "health check round")

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
        sampled = time.monotonic()
        await asyncio.gather(*(self._refresh_load(r) for r in self.registry.live()))
        await self.adapters.report_held(self.router, self.registry.live(), sampled)

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
        """Start a new actor in a dead worker's slot, or give up on it. An expert-parallel
        group is replaced whole: its other ranks cannot go on without the dead one."""
        group = self._group_of(rec)
        async with self._group_locks.setdefault(group[0].index, asyncio.Lock()):
            if rec.state != "dead" or rec.retiring:
                return  # replaced meanwhile (with its group), or being drained away
            fleet = self.cfg.fleet
            for other in group:
                if other is not rec and other.state not in ("dead", "failed"):
                    self._mark_dead(other, f"its expert-parallel group lost {rec.worker_id}: "
                                           f"{rec.error}")
                self._kill(other)  # a failed engine's actor still runs: it holds a bundle
            if not fleet.restart_dead_workers or rec.restarts >= fleet.max_restarts:
                for other in group:
                    other.set_state("failed")
                logger.error("worker %s stays down (restarts %d, limit %d, restarts %s)",
                             rec.worker_id, rec.restarts, fleet.max_restarts,
                             "on" if fleet.restart_dead_workers else "off")
                await self._publish()
                return
            for other in group:
                other.restarts += 1
                other.generation += 1
            logger.warning("restarting worker %s (restart %d)%s", rec.worker_id, rec.restarts,
                           f" with its expert-parallel group {[r.worker_id for r in group]}"
                           if len(group) > 1 else "")
            await self._names_released(group)
            await self._launch_group(group)
            await asyncio.gather(*(self._await_ready(r) for r in group))
        await self._publish()

    @staticmethod
    def _kill(rec: WorkerRecord) -> None:
        import ray
        if rec.handle is None:
            return
        try:
            ray.kill(rec.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    async def _publish(self) -> None:
        """Tell the router which workers take new requests (and their roles), and their
        weight versions; a disaggregated fleet that lost its handshake tries again."""
        if self.cfg.fleet.disaggregated and self._info is not None:
            await self.pd.handshake(self.registry)
        self._checkpoint()
        if self.router is None:
            return
        try:
            await self.router.set_workers.remote(
                self.registry.routable(), {r.worker_id: r.role for r in self.registry},
                self.policy)
            await self.router.set_weight_versions.remote(
                {r.worker_id: r.weight_version for r in self.registry.live()})
        except Exception as exc:
            if not actor_unreachable(exc):
                raise
            logger.warning("router unreachable (%s): it asks for the workers when it is back",
                           type(exc).__name__)


def controller_actor_class():
    import ray
    return ray.remote(Controller)

