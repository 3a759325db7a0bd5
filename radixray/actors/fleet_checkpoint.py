"""What a restarted controller cannot learn from its workers, kept in Ray's GCS store.

The controller is a restartable actor: when its process dies, Ray starts it again with
the same constructor arguments, and the workers and the router (named, detached actors)
keep serving meanwhile. Most of its state comes back from them (each worker's role,
draining flag, weight version, KV endpoint). What only the controller knew is written
here after every change of the fleet, the way Ray Serve's own controller checkpoints
into the GCS key-value store: the placement group the workers live in (its own, or a
GRPO job's it adopted), each slot's incarnation and restart count, the fleet's weight
version with the update a restarted worker replays, whether the whole fleet drains, and
which workers the autoscaler was draining away (the next controller finishes that).

The checkpoint is small (a few hundred bytes plus the pickled placement group) and is
deleted when the fleet stops on purpose.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger("radixray.controller")

NAMESPACE = b"radixray"


@dataclass
class FleetCheckpoint:
    """The controller's own facts about a fleet (see the module docstring)."""

    placement_group: object = None  # ray.util.placement_group.PlacementGroup
    first_bundle: int = 0
    owns_placement_group: bool = True
    draining: bool = False
    weight_version: int | str = 0  # an int or a string label (engine/weights/version.py)
    replay: object = None  # the last update (DiskWeights) when a worker can repeat it
    stale: set[str] = field(default_factory=set)
    policy: str | None = None  # the routing policy set at run time
    slots: dict[str, tuple[int, int]] = field(default_factory=dict)  # worker -> (gen, restarts)
    weight_version_floor: int = 0  # the greatest int version served (an older pickle: 0)
    # an autoscaled fleet: worker -> (slot index, role, its own placement group)
    layout: dict[str, tuple[int, str, object]] | None = None
    lora_adapters: dict[str, str] | None = None  # the fleet's LoRA adapters (None: as configured)
    lora_updates: dict | None = None  # adapter -> fleet_lora.AdapterUpdates (their versions)
    retiring: frozenset = frozenset()  # workers the autoscaler was draining away


def _key(controller_name: str) -> bytes:
    return f"fleet-checkpoint/{controller_name}".encode()


def save(controller_name: str, checkpoint: FleetCheckpoint) -> None:
    """Overwrite the checkpoint (a failure is logged: the fleet serves on without it)."""
    from ray import cloudpickle
    from ray.experimental import internal_kv
    try:
        internal_kv._internal_kv_put(_key(controller_name), cloudpickle.dumps(checkpoint),
                                     overwrite=True, namespace=NAMESPACE)
    except Exception as exc:  # noqa: BLE001 - the GCS may be briefly unreachable
        logger.warning("could not checkpoint the fleet: %s", exc)


def load(controller_name: str) -> FleetCheckpoint | None:
    """The last checkpoint, or None when this fleet never wrote one (a first start)."""
    from ray import cloudpickle
    from ray.experimental import internal_kv
    data = internal_kv._internal_kv_get(_key(controller_name), namespace=NAMESPACE)
    return None if data is None else cloudpickle.loads(data)


def delete(controller_name: str) -> None:
    from ray.experimental import internal_kv
    try:
        internal_kv._internal_kv_del(_key(controller_name), namespace=NAMESPACE)
    except Exception:  # noqa: BLE001 - stopping anyway
        pass


def release_orphaned(controller_name: str) -> None:
    """The controller is gone for good without stopping its fleet: remove the placement
    groups it created (the fleet's, or each autoscaled worker's; not one it adopted) and
    the checkpoint."""
    saved = load(controller_name)
    if saved is not None:
        groups = [g for _, _, g in (saved.layout or {}).values() if g is not None]
        if saved.owns_placement_group and saved.placement_group is not None:
            groups.append(saved.placement_group)
        from ray.util import remove_placement_group
        for group in groups:
            try:
                remove_placement_group(group)
            except Exception as exc:  # noqa: BLE001 - already removed
                logger.warning("could not remove the fleet's placement group: %s", exc)
    delete(controller_name)
