"""One placement group per GRPO job: the trainer's bundles first, then one per engine worker.

A job that starts its own fleet reserves everything it will use in one group (strategy:
the fleet's ``placement_strategy``, PACK by default, so one node when it fits), hands the
worker bundles to the fleet's controller and puts the trainer on bundle 0 (a sharded
trainer, ``trainer_ranks`` > 1: rank r on bundle r). What a trainer bundle asks for
follows the placement:

- ``colocated``: memory only (the trainer shares the workers' CPUs, which are paused while
  it trains): an estimate of the trainer's bytes, so the group lands on a node with room;
- ``separate``: a CPU (and a GPU when the engine runs on CUDA) of its own.

A job that joins a running fleet (``radixray serve`` started elsewhere) cannot move its
workers; its group then holds the trainer's bundles alone.
"""

from __future__ import annotations

import glob
import os
import uuid

TRAINER_BYTES_PER_WEIGHT_BYTE = 4  # weights, gradients and AdamW's two moments


def trainer_memory_bytes(model_path: str, kl: bool, deterministic: bool, ranks: int = 1) -> int:
    """Estimated resident bytes of one trainer process: 4x its fp32 weights (weights,
    gradients, two AdamW moments), plus a frozen reference copy with KL, plus the
    deterministic scorer's copy. Of ``ranks`` > 1 FSDP ranks each holds 1/ranks of the
    first two, plus the full weights it gathers for a sync (and loads before sharding).
    The weights' size is read from the checkpoint's safetensors files."""
    weights = sum(os.path.getsize(f) for f in glob.glob(os.path.join(model_path, "*.safetensors")))
    sharded = TRAINER_BYTES_PER_WEIGHT_BYTE + int(kl)
    copies = (sharded if ranks == 1 else sharded / ranks + 1) + int(deterministic)
    return int(max(weights, 1) * copies)


class JobPlacement:
    """The job's placement group and the trainer's options within it: ``trainer_ranks``
    bundles alike (one per trainer rank), then the workers'."""

    def __init__(self, placement: str, device: str, trainer_bytes: int,
                 worker_bundles: list[dict], strategy: str, trainer_ranks: int = 1):
        from ray.util import placement_group
        if placement == "colocated":
            self.trainer_bundle = {"memory": trainer_bytes}
            self.trainer_options = {"num_cpus": 0, "memory": trainer_bytes}
        else:
            gpus = 0 if device == "cpu" else 1
            self.trainer_bundle = {"CPU": 1, **({"GPU": gpus} if gpus else {})}
            self.trainer_options = {"num_cpus": 1, "num_gpus": gpus}
        self.trainer_ranks = trainer_ranks
        self.worker_bundles = [dict(b) for b in worker_bundles]
        self.group = placement_group(self._bundles(), strategy=strategy,
                                     name=f"grpo-{uuid.uuid4().hex[:8]}")

    def _bundles(self) -> list[dict]:
        return [dict(self.trainer_bundle) for _ in range(self.trainer_ranks)] + self.worker_bundles

    def ready(self, timeout_s: float = 600.0) -> None:
        """Wait until every bundle is reserved; TimeoutError says what the group asks for."""
        import ray
        ready, _ = ray.wait([self.group.ready()], timeout=timeout_s)
        if not ready:
            raise TimeoutError(
                f"the job's placement group was not placed within {timeout_s:.0f} s: it asks "
                f"for {self._bundles()}; the cluster has "
                f"{ray.available_resources()} free")

    def trainer(self, rank: int = 0) -> dict:
        """Actor options that put the trainer (its rank ``rank``) on bundle ``rank``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        return {**self.trainer_options, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            self.group, placement_group_bundle_index=rank)}

    def remove(self) -> None:
        from ray.util import remove_placement_group
        remove_placement_group(self.group)
