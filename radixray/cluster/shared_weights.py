"""Named tensors in one shared-memory file: a colocated trainer writes, workers read in place.

``ray.put`` of a model's worth of arrays copies them into the object store and faults
in fresh shared pages on every step (1.5 s for SmolLM2-135M's 540 MB on the 2-vCPU
EPYC, three times the whole update; docs/benchmarks.md). A trainer that sends weights
every step keeps one file under ``/dev/shm`` instead: :class:`SharedWeightsWriter`
lays the tensors out once (64-byte aligned), :meth:`~SharedWeightsWriter.write` copies
the new values over the old ones (pages already resident), and the small
:class:`SharedWeightsHandle` it returns travels through Ray to the workers, which map
the file once per process and read the tensors in place (:func:`read_shared`).

The file is the trainer's: a worker reads it only during its ``update_weights`` call,
and the trainer must not write it again until that call returned.
"""

from __future__ import annotations

import mmap
import os
import uuid
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from radixray.cluster.node_address import node_ip

_ALIGN = 64
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_MAPS: dict[str, tuple[int, mmap.mmap, torch.Tensor]] = {}  # path -> (inode, map, bytes view)


@dataclass(frozen=True)
class SharedWeightsHandle:
    """Where each tensor lies in the file: ``(name, dtype name, shape, byte offset)``;
    ``node_ip``: the Ray node the file is on (None outside Ray): only a reader on that node
    can map it; ``elsewhere``: how a reader on another node gets the tensors."""

    path: str
    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]
    nbytes: int
    node_ip: str | None = None
    # (ObjectRef of the same tensors as a to_payload list,) for a reader on another node;
    # nested in a tuple so Ray resolves it only for the reader that asks
    elsewhere: tuple = ()


class SharedWeightsWriter:
    """The trainer's side: a file sized for ``named``'s tensors (same names, shapes and
    dtypes on every :meth:`write`)."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]] | dict, directory: str = "/dev/shm"):
        items = list(named.items() if isinstance(named, dict) else named)
        entries, offset = [], 0
        for name, tensor in items:
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise ValueError(f"tensor {name!r}: dtype {dtype} cannot be shared (use one of "
                                 f"{sorted(_DTYPES)})")
            entries.append((name, dtype, tuple(tensor.shape), offset))
            offset += (tensor.numel() * tensor.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
        self.path = os.path.join(directory, f"radixray-weights-{uuid.uuid4().hex[:12]}")
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(offset, 1))
            self._map = mmap.mmap(fd, max(offset, 1))
        finally:
            os.close(fd)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.handle = SharedWeightsHandle(self.path, tuple(entries), offset, node_ip())
        self._index = {e[0]: e for e in entries}

    def write(self, named: Iterable[tuple[str, torch.Tensor]] | dict) -> SharedWeightsHandle:
        """Copy the tensors into their places (every name must be one the file was laid
        out for, with the same shape); returns the handle to send to the workers."""
        items = named.items() if isinstance(named, dict) else named
        for name, tensor in items:
            entry = self._index.get(name)
            if entry is None:
                raise ValueError(f"tensor {name!r} is not in this shared weights file")
            _view(self._bytes, entry).copy_(tensor.detach())
        return self.handle

    def close(self) -> None:
        """Remove the file (workers' mappings stay valid until they drop them)."""
        if os.path.exists(self.path):
            os.unlink(self.path)


def on_this_node(handle: SharedWeightsHandle) -> bool:
    """Whether this process can map ``handle``'s file (it is on the writer's node)."""
    return handle.node_ip is None or handle.node_ip == node_ip()


def _view(data: torch.Tensor, entry) -> torch.Tensor:
    _, dtype, shape, offset = entry
    kind = _DTYPES[dtype]
    numel = 1
    for d in shape:
        numel *= d
    return data[offset:offset + numel * kind.itemsize].view(kind).view(shape)


def read_shared(handle: SharedWeightsHandle) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into the file (mapped once per process; a new file at the
    same path is mapped again). Read them during the update call only."""
    inode = os.stat(handle.path).st_ino
    cached = _MAPS.get(handle.path)
    if cached is None or cached[0] != inode or len(cached[1]) < handle.nbytes:
        with open(handle.path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():  # read-only mapping: the tensors are only read
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(mapped, dtype=torch.uint8)
        cached = _MAPS[handle.path] = (inode, mapped, data)
    for entry in handle.entries:
        yield entry[0], _view(cached[2], entry)
