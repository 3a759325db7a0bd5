"""A weight-update session aimed at one LoRA adapter (``begin_weight_update(lora_name=...)``).

The session (engine/weights/session.py) stages PEFT-named tensors
(``...layers.<i>.self_attn.q_proj.lora_A.weight``, any subset) from its three transports
into an :class:`AdapterStage`: a copy of the serving adapter in host memory, beside the one
the adapter slots serve, so requests go on with the old weights while the new ones arrive.
A PEFT folder from disk replaces the whole adapter (any rank up to the slots', its own
config's scalings); a single ``.safetensors`` file, tensors or a broadcast replace the A or
B matrices they name, keeping the adapter's ranks and scalings. A name outside the served
projections, a weight the adapter lacks or another shape is a ValueError naming the tensor
(peft_adapter.py's checks), and the session ends with the old adapter serving.

Ending it: :meth:`AdapterStage.prepare` checks the version against the adapter's own
(lora_slots.py: the base weights' rules, per adapter; the base version does not move) and
:func:`commit_adapter` serves the staged adapter between scheduler steps: a new radix-cache
namespace (only this adapter's cached KV is retired), its slot refilled, running requests of
it stamped with the version. :meth:`AdapterCommit.rollback` serves the old adapter again
(a fleet-wide update that failed elsewhere).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from radixray.engine.weights.lora_slots import LoraSlots, unknown_adapter
from radixray.engine.weights.peft_adapter import (
    LoraAdapter,
    checked_update,
    read_peft_adapter,
    updated_adapter,
)
from radixray.engine.weights.version import WeightVersion


class AdapterStage:
    """New weights for served adapter ``name``, staged in host memory (see the module
    docstring). The session calls it under its lock; nothing here touches the slots."""

    def __init__(self, slots: LoraSlots | None, name: str):
        if slots is None or slots.namespace(name) is None:
            raise unknown_adapter("begin_weight_update", slots, name)
        self.slots, self.name = slots, name
        self.namespace = slots.namespace(name)  # the adapter as loaded when the session began
        self.adapter: LoraAdapter = slots.adapter(name)  # the serving one until a tensor lands
        self.tensors = 0
        self.bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.add_all([(name, tensor)])

    def add_all(self, named) -> None:
        """Replace the A or B matrices the PEFT-named tensors name (ValueError naming one that
        does not fit; nothing of this call is kept then)."""
        named = list(named)
        self.adapter = updated_adapter(self.adapter, named, self.slots.num_layers)
        self.tensors += len(named)
        self.bytes += sum(t.numel() * t.element_size() for _, t in named)

    def read_disk(self, path: str) -> None:
        """A PEFT folder: the whole adapter (config and weights); a ``.safetensors`` file: the
        A and B matrices it holds. ValueError naming the adapter or the tensor otherwise."""
        if not os.path.isdir(path):
            from safetensors.torch import load_file
            if not os.path.isfile(path):
                raise ValueError(f"LoRA adapter {self.name!r}: {path} is neither a PEFT folder "
                                 f"nor a .safetensors file")
            self.add_all(load_file(path).items())
            return
        new = read_peft_adapter(self.name, path, self.slots.num_layers)
        self.slots.check(new, replacing=True)
        self.adapter = new
        for a, b in new.weights.values():
            self.tensors += 2
            self.bytes += (a.numel() + b.numel()) * a.element_size()

    def check_shape(self, name: str, shape) -> None:
        """ValueError naming tensor ``name`` unless a ``shape`` tensor of that name fits (before
        a broadcast is received)."""
        checked_update(self.adapter, [(name, torch.empty(tuple(shape), device="meta"))],
                       self.slots.num_layers)

    def buffer_for(self, name: str, dtype: torch.dtype) -> None:
        """No in-place receive: a broadcast lands in a temporary, then :meth:`add`."""
        return None

    def missing(self) -> list[str]:
        """Tensors not sent keep their serving values: nothing is ever missing."""
        return []

    def prepare(self, version: WeightVersion | None) -> PreparedAdapter:
        """The staged adapter to serve as ``version`` (None: the adapter's next int);
        VersionRefused against the adapter's own versions, changing nothing."""
        return PreparedAdapter(self.adapter, self.slots.check_version(self.name, version),
                               self.namespace, self.tensors, self.bytes)


@dataclass(frozen=True)
class PreparedAdapter:
    adapter: LoraAdapter
    version: WeightVersion
    namespace: int  # the serving adapter's when the session began
    tensors: int
    bytes: int


@dataclass(frozen=True)
class AdapterCommit:
    """A committed adapter update, until finished: what serves again on rollback."""

    slots: LoraSlots
    old: LoraAdapter
    old_version: WeightVersion
    old_floor: int
    version: WeightVersion
    running: int  # requests of the adapter that were running at the commit

    @property
    def name(self) -> str:
        return self.old.name

    def rollback(self, held: list) -> None:
        """Scheduler thread: the old adapter and version serve again (its cached KV of the
        new weights is never matched)."""
        self.slots.replace(self.old, self.old_version, held, floor=self.old_floor)

    def report(self) -> dict:
        return {"lora_name": self.name, "lora_version": self.version,
                "previous_version": self.old_version, "running_requests": self.running}


def commit_adapter(prepared: PreparedAdapter, slots: LoraSlots, held: list) -> AdapterCommit:
    """Scheduler thread: serve the prepared adapter from the next step on (see the module
    docstring). ValueError when the adapter was unloaded (or unloaded and loaded again) since
    the session began: nothing changes then."""
    name = prepared.adapter.name
    if slots.namespace(name) is None:
        raise unknown_adapter("commit_weight_update", slots, name)
    if slots.namespace(name) != prepared.namespace:
        raise ValueError(f"commit_weight_update: LoRA adapter {name!r} was loaded again while "
                         f"the session staged its update; begin a new session")
    old, old_version, old_floor = slots.adapter(name), slots.version(name), slots.floor(name)
    running = slots.replace(prepared.adapter, prepared.version, held)
    return AdapterCommit(slots, old, old_version, old_floor, prepared.version, running)


def update_adapter(weights, name: str, lora_path: str | None, named_tensors,
                   version: WeightVersion | None, call_in_loop) -> dict:
    """``Engine.update_lora_adapter``: a one-call session of ``weights`` (the engine's
    WeightUpdater) for adapter ``name`` from a PEFT folder (or one .safetensors file) or
    PEFT-named tensors; ``finish``'s report. Any failure, a refused version too, ends the
    session with the old adapter serving."""
    if (lora_path is None) == (named_tensors is None):
        raise ValueError("update_lora_adapter: give exactly one of lora_path and named_tensors")
    weights.begin(name)
    try:
        if lora_path is not None:
            weights.update_from_disk(lora_path)
        else:
            weights.update_from_tensor(named_tensors)
        return weights.end(version, call_in_loop)
    except BaseException:
        weights.abort()
        raise
