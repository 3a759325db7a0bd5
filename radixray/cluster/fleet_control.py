"""The controller's control surface: the verbs it applies to every live worker of the fleet.

The engine's verbs are declared in :mod:`radixray.engine.control`; the controller
(actors/fleet_ops.py) implements these, each an engine verb applied to every worker
except ``update_weights``, which drives the engine's weight-update steps on every worker,
all or none (actors/weight_rollout.py).
"""

from __future__ import annotations

from typing import Protocol

from radixray.cluster.weight_sources import WeightSource
from radixray.engine.control import verbs_of
from radixray.engine.messages import DEFAULT_GROUP


class FleetControl(Protocol):
    """The verbs a controller applies to every live worker (actors/fleet_ops.py). Results
    are keyed by worker id; a worker's error is its entry (``{"error": ...}``). A fleet
    weight update is one verb (``update_weights``) that runs the engine's steps on every
    worker, all or none."""

    async def pause_generation(self, mode: str) -> dict: ...

    async def continue_generation(self) -> dict: ...

    async def release_memory_occupation(self, tags: list[str] | None = None) -> dict: ...

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> dict: ...

    async def flush_cache(self) -> dict: ...

    async def rebalance_experts(self) -> dict: ...

    async def check_kv_conservation(self) -> dict: ...

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> dict: ...

    async def get_weight_version(self) -> dict: ...

    async def update_weight_version(self, new_version: int | str) -> dict: ...

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict: ...

    async def unload_lora_adapter(self, lora_name: str) -> dict: ...

    async def update_lora_adapter(self, lora_name: str, lora_path: str,
                                  lora_version: int | str | None = None) -> dict: ...

    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        world_size: int, group_name: str = DEFAULT_GROUP,
                                        backend: str = "gloo",
                                        timeout_s: float = 600.0) -> dict: ...

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> dict: ...

    async def update_weights(self, source: WeightSource,
                             weight_version: int | str | None = None,
                             pause_mode: str | None = "retract",
                             release_memory: list[str] = (), keep_paused: bool = False
                             ) -> dict: ...


FLEET_VERBS = verbs_of(FleetControl)
# Fleet verbs that are not one engine verb applied to every worker.
FLEET_ONLY_VERBS = frozenset({"update_weights"})
