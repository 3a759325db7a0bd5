"""Weight updates at tensor parallelism: the driver's session, mirrored on every follower.

The driver runs the update session as at one rank (engine/weights/session.py) and relays
each of its steps to the followers over the step channel, in order with the forward passes:
``begin``, the staged tensors, ``prepare``, ``commit`` (between two steps, as on the driver),
``rollback``, ``abort``, ``finish``. Each rank keeps only its slice of every tensor
(engine/tp/sharding.py), so every source gives the followers the *full* Hugging Face tensor:

- disk: each rank reads the checkpoint itself (``disk`` carries the path);
- tensors and a trainer's broadcast: the driver receives the full tensors once and relays
  them, batched up to ``RELAY_BATCH_BYTES`` a message (one broadcast per batch, not per rank;
  the trainer's group holds the driver only).

A follower cannot answer on the channel: a step that fails there (it should not: the driver
validated the same names and shapes first) ends the follower, which fails the driver's next
collective, and the worker is restarted as a unit.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

RELAY_BATCH_BYTES = 64 * 2**20


@dataclass
class WeightOp:
    """One step of the driver's update session, for the followers."""

    kind: str  # begin | tensors | disk | prepare | commit | rollback | abort | finish
    args: tuple = ()


class WeightRelay:
    """The driver's side: sends the session's steps and the full tensors it stages."""

    def __init__(self, tp):
        self.tp = tp
        self._pending: list[tuple[str, torch.Tensor]] = []
        self._bytes = 0
        self.paused = False  # a disk update: the followers read the files themselves

    def op(self, kind: str, *args) -> None:
        self.flush()
        self.tp.send(WeightOp(kind, args))

    def tensor(self, name: str, tensor: torch.Tensor) -> None:
        """``tensor`` (a full checkpoint tensor the driver just staged) goes to the followers."""
        if self.paused:
            return
        self._pending.append((name, tensor.detach().to("cpu", copy=True)))
        self._bytes += tensor.numel() * tensor.element_size()
        if self._bytes >= RELAY_BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            batch, self._pending, self._bytes = self._pending, [], 0
            self.tp.send(WeightOp("tensors", (batch,)))


class FollowerWeights:
    """A follower's side: the same session over its own shard of the model."""

    def __init__(self, model):
        self.model = model
        self._layout = None
        self._stage = None
        self._prepared = None
        self._undo = None

    def apply(self, op: WeightOp) -> None:
        from radixray.engine.weights.layout import WeightLayout, WeightStage
        kind = op.kind
        if kind == "begin":
            if self._layout is None:
                self._layout = WeightLayout(self.model)
            self._stage, self._prepared = WeightStage(self._layout), None
        elif kind == "tensors":
            for name, tensor in op.args[0]:
                self._stage.add(name, tensor)
        elif kind == "disk":
            self._read_disk(op.args[0])
        elif kind == "prepare":
            self._prepared, self._stage = self._stage.prepare(), None
        elif kind == "commit":
            self._undo, self._prepared = self._prepared.commit(), None
        elif kind == "rollback":
            if self._undo is not None:
                self._undo.rollback()
            self._undo = None
        elif kind == "abort":
            self._stage = self._prepared = None
        elif kind == "finish":
            self._undo = None
        else:
            raise ValueError(f"unknown weight op {kind!r}")

    def _read_disk(self, path: str) -> None:
        from safetensors import safe_open

        from radixray.engine.weights.loader import safetensors_files
        for file in safetensors_files(path):
            with safe_open(file, framework="pt") as st:
                for name in st.keys():
                    self._stage.add(name, st.get_tensor(name))
        logger.info("tensor-parallel follower staged %s%s", path,
                    " (a folder)" if os.path.isdir(path) else "")
