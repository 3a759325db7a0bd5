"""Where a worker's actors go: its placement group and the bundles in it.

A fixed fleet's workers share one placement group (the controller's, or a GRPO job's it
adopted), slot ``i`` in the bundles ``cfg.slot_bundles()[i]`` past the group's first.
An autoscaled fleet gives every worker a group of its own (one bundle per
tensor-parallel rank), created when the worker starts and removed when it is drained
away: on a Ray cluster with an autoscaler (KubeRay ``enableInTreeAutoscaling: true``) a
group that does not fit is what asks for a node, and removing it is what lets the node go.
"""

from __future__ import annotations

import logging

from radixray.cluster.config import ServeConfig
from radixray.cluster.registry import WorkerRecord

logger = logging.getLogger("radixray.controller")


def slot_placement(cfg: ServeConfig, rec: WorkerRecord, shared_group,
                   first_bundle: int) -> tuple[object, list[int]]:
    """(placement group or None, bundle indices: the worker's, then its TP followers')."""
    if rec.placement_group is not None:
        return rec.placement_group, list(range(len(cfg.role_bundles(rec.role))))
    if shared_group is None:
        return None, [0] * cfg.engine_options_for(rec.role)["tp_size"]
    return shared_group, [first_bundle + i for i in cfg.slot_bundles()[rec.index]]


def in_bundle(group, index: int) -> dict:
    """Actor or task options that place it in bundle ``index`` of ``group`` ({} without)."""
    if group is None:
        return {}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=index)}


async def own_group(cfg: ServeConfig, rec: WorkerRecord) -> None:
    """Give ``rec`` a placement group of its own (an autoscaled fleet's worker) unless it
    has one or workers reserve nothing; waits until Ray placed it (a cluster autoscaler
    may first add a node)."""
    bundles = cfg.role_bundles(rec.role)
    if rec.placement_group is not None or not bundles:
        return
    from ray.util import placement_group
    rec.placement_group = placement_group(
        bundles, strategy=cfg.fleet.placement_strategy, lifetime="detached",
        name=f"{cfg.controller_name()}-{rec.worker_id}")
    await rec.placement_group.ready()
    logger.info("worker %s has its own placement group %s", rec.worker_id, bundles)


def remove_group(rec: WorkerRecord) -> None:
    """Release the placement group of ``rec``'s own, if any (its resources go back)."""
    if rec.placement_group is None:
        return
    from ray.util import remove_placement_group
    try:
        remove_placement_group(rec.placement_group)
    except Exception as exc:  # noqa: BLE001 - already removed
        logger.warning("could not remove %s's placement group: %s", rec.worker_id, exc)
    rec.placement_group = None


def workers_per_node(cfg: ServeConfig) -> int:
    """How many workers share a node's cores: PACK puts every bundle on one node when it
    fits (the local and single-node case; an autoscaled fleet's largest size); SPREAD
    strategies put one per node."""
    if "SPREAD" in cfg.fleet.placement_strategy:
        return 1
    return cfg.fleet.max_workers() * cfg.engine.ep_size


async def rendezvous(group, index: int) -> str:
    """``tcp://ip:port`` free on the node of bundle ``index`` (a task placed there): where
    the ranks of an expert-parallel group meet."""
    import ray
    return await ray.remote(_free_address).options(num_cpus=0,
                                                    **in_bundle(group, index)).remote()


def _free_address() -> str:
    """A rendezvous address for torch.distributed on this node (run as a Ray task)."""
    import ray

    from radixray.engine.ep.group import free_tcp_address
    return free_tcp_address(ray.util.get_node_ip_address())
