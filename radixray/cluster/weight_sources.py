"""Where a fleet-wide weight update takes the new weights from: one dataclass per kind.

A source is built by whoever asks for the update (the HTTP ingress, an RL job, a
benchmark), travels to the controller through Ray and is staged on every worker
(actors/weight_rollout.py dispatches on its type). Plain picklable dataclasses, free of
torch and Ray at import, so the ingress can build them cheaply.

Every kind takes ``lora_name``: the update is then for that served LoRA adapter, with
PEFT-named tensors (a PEFT folder from disk: the whole adapter), under the adapter's own
version (engine/weights/adapter_stage.py; actors/fleet_lora.py runs it fleet-wide).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixray.engine.messages import DEFAULT_GROUP

if TYPE_CHECKING:
    from radixray.cluster.shared_weights import SharedWeightsHandle


@dataclass(frozen=True)
class _Source:
    lora_name: str | None = field(default=None, kw_only=True)  # None: the base weights


@dataclass(frozen=True)
class DiskWeights(_Source):
    """A Hugging Face folder or a .safetensors file that every worker can read. The only
    kind a restarted worker can repeat on its own to catch up with the fleet. For an
    adapter: a PEFT folder, or a .safetensors file of some of its tensors."""

    path: str

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("a disk update needs model_path")


@dataclass(frozen=True)
class TensorWeights(_Source):
    """Tensors from the caller's process: ``shared``, the handle of a colocated trainer's
    shared-memory file (:class:`SharedWeightsWriter`, the fast path, readable on the
    trainer's node only), and/or ``payload``, the ObjectRef of a
    :func:`~radixray.cluster.tensor_payload.to_payload` list, which a worker maps from the
    object store. With both, a worker on the file's node reads the file and any other
    fetches the payload. (Held inside this object, the ref passes through the controller
    unresolved.)"""

    shared: SharedWeightsHandle | None = None
    payload: object = None

    def __post_init__(self) -> None:
        if self.shared is None and self.payload is None:
            raise ValueError("a tensor update needs shared=SharedWeightsWriter(...)"
                             ".write(named) or payload=ray.put(to_payload(named)), or both")


@dataclass(frozen=True)
class DistributedWeights(_Source):
    """The tensors a trainer (rank 0) broadcasts over ``group_name``, in this order, with
    these dtypes and shapes (the group is joined first: the controller's
    ``init_weights_update_group``)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError("a distributed update needs names, dtypes and shapes")


WeightSource = DiskWeights | TensorWeights | DistributedWeights


def check_source(source) -> None:
    """TypeError unless ``source`` is one of the kinds above."""
    if not isinstance(source, (DiskWeights, TensorWeights, DistributedWeights)):
        raise TypeError(f"a weight source is a DiskWeights, TensorWeights or "
                        f"DistributedWeights, got {type(source).__name__}")
