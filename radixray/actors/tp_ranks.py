"""A served tensor-parallel worker's follower ranks: one Ray actor each, in a placement
bundle of its own.

The worker actor (actors/engine_worker.py) is the group's driver, rank 0, in its slot's
first bundle; :class:`TPRanks` starts ranks 1..tp_size-1 as :class:`TPRankActor` actors in
the slot's other bundles (the controller lays them out: cluster/config.py
``slot_bundles``), so each rank reserves its own CPUs or GPU, and a bundle on another node
puts that rank there. The ranks meet at a rendezvous on the driver's node; each follower
advertises what peers reach (its KV transfer engine) on its own node's address.

The followers are owned by the worker actor: Ray kills them with it (a group restarts as a
unit when the controller replaces its worker). A follower that dies first makes the
worker's ping report the engine failed, so the controller replaces the group at once
instead of at the next step's failed collective.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from radixray.cluster.node_address import node_ip, node_local_options

logger = logging.getLogger("radixray.worker")

STOP_WAIT_S = 30.0


@dataclasses.dataclass(frozen=True)
class TPPlacement:
    """Where a worker's follower ranks go: ``bundles[i]`` of ``group`` holds rank i + 1
    (``group`` None: no placement group, each rank reserves ``num_cpus`` / ``num_gpus``)."""

    group: object  # ray.util.placement_group.PlacementGroup | None
    bundles: tuple[int, ...]
    num_cpus: float = 0.0
    num_gpus: float = 0.0

    def actor_options(self, rank: int) -> dict:
        """Ray actor options of follower ``rank`` (1-based: rank 0 is the worker)."""
        options = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=self.bundles[rank - 1])
        return options


class TPRankActor:
    """One follower rank of a served tensor-parallel worker (``ray.remote`` of it:
    :func:`TPRanks`)."""

    def __init__(self, log_level: str = "INFO"):
        logging.basicConfig(level=log_level.upper(), format="[%(asctime)s] %(message)s",
                            datefmt="%Y-%m-%d %H:%M:%S")

    def where(self) -> dict:
        """This rank's node address and process id."""
        return {"node_ip": node_ip(), "pid": os.getpid()}

    def run(self, engine_options: dict, rank: int, init_method: str) -> None:
        """Join the group at ``init_method`` as ``rank`` and follow the driver until it
        stops (returns) or dies (raises)."""
        from radixray.engine.config import EngineConfig
        from radixray.engine.tp.follower import run_follower
        config = EngineConfig.from_kwargs(**node_local_options(engine_options))
        run_follower(config, rank, init_method, own_device=True)


class TPRanks:
    """The follower rank actors of one worker, started (not yet joined) by the constructor;
    the driver joins the group at :attr:`init_method` next (``Engine(tp_init_method=...)``)."""

    def __init__(self, placement: TPPlacement, engine_options: dict, worker_id: str,
                 log_level: str = "INFO"):
        import ray

        from radixray.engine.ep.group import free_tcp_address
        size = engine_options["tp_size"]
        if len(placement.bundles) not in (0, size - 1):
            raise ValueError(f"a worker of tp_size {size} needs {size - 1} follower bundles, "
                             f"got {len(placement.bundles)}")
        self.worker_id = worker_id
        self.init_method = free_tcp_address(node_ip() or "127.0.0.1")
        cls = ray.remote(TPRankActor)
        self.actors = [cls.options(max_concurrency=2,
                                   **placement.actor_options(rank)).remote(log_level)
                       for rank in range(1, size)]
        self.runs = [actor.run.remote(engine_options, rank, self.init_method)
                     for rank, actor in enumerate(self.actors, start=1)]
        logger.info("worker %s: started %d tensor-parallel follower rank actor(s); the group "
                    "meets at %s", worker_id, len(self.actors), self.init_method)

    def where(self) -> list[dict]:
        """Each follower's rank, node address and process id."""
        import ray
        places = ray.get([actor.where.remote() for actor in self.actors])
        return [{"rank": rank, **place} for rank, place in enumerate(places, start=1)]

    def dead(self) -> str | None:
        """Why the group lost a follower (its actor died or its loop ended), or None."""
        import ray
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        for ref in done:
            rank = self.runs.index(ref) + 1
            try:
                ray.get(ref)
                return f"tensor-parallel rank {rank} stopped following"
            except Exception as exc:  # noqa: BLE001 - the rank's death, whatever its kind
                return f"tensor-parallel rank {rank} died: {type(exc).__name__}: {exc}"[:500]
        return None

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """After the driver sent Stop (the engine's shutdown): wait up to ``wait_s`` for the
        followers to leave, then kill them (also any that did not)."""
        import ray
        if wait_s > 0:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=wait_s)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
