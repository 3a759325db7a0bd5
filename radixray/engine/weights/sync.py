"""Process groups for sending weights from a trainer to engines with torch.distributed.

The trainer is rank 0 and every engine that takes part joins with its own rank
(``rank_offset`` plus its local rank). The group is its own process group over its
own TCPStore, apart from any default group either side may have, so a trainer's
``torch.distributed`` setup and an engine's never collide. ``gloo`` works on CPU
tensors (pinned to the master address's interface, loopback in tests); ``nccl``
on CUDA tensors.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` / a torch dtype -> the torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[key]


def open_group(master_address: str, master_port: int, rank: int, world_size: int,
               group_name: str = "weight_update_group", backend: str = "gloo",
               timeout_s: float = 600.0) -> dist.ProcessGroup:
    """Join (rank 0: create) the group ``group_name``; blocks until all ``world_size`` ranks
    have joined or ``timeout_s`` passes. ValueError names a bad argument."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group's world_size {world_size} "
                         f"(rank_offset + local rank must be < world_size)")
    if not 0 < int(master_port) < 65536:
        raise ValueError(f"master_port must be in [1, 65535], got {master_port}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0,
                          timeout=timeout)
    store = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=master_address)]
        options._timeout = timeout
        group = dist.ProcessGroupGloo(store, rank, world_size, options)
    else:
        group = dist.ProcessGroupNCCL(store, rank, world_size)
    logger.info("joined weight-update group %r as rank %d of %d (%s, master %s:%s)",
                group_name, rank, world_size, backend, master_address, master_port)
    return group


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> None:
    """Broadcast ``tensor`` in place from rank ``src`` to every rank of ``group``."""
    options = dist.BroadcastOptions()
    options.rootRank = src
    group.broadcast([tensor], options).wait()


def close_group(group: dist.ProcessGroup | None) -> None:
    """Shut ``group``'s backend down (None: nothing)."""
    if group is not None and hasattr(group, "shutdown"):
        group.shutdown()


class WeightBroadcaster:
    """The trainer's side (rank 0): send named tensors to every engine of the group.

    Tell the engines what comes first (``update_weights_from_distributed(names, dtypes,
    shapes)`` on each, without waiting), then call :meth:`send` with the same tensors in
    the same order; :meth:`spec` gives those three lists.
    """

    def __init__(self, master_address: str, master_port: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str = "gloo",
                 timeout_s: float = 600.0):
        self.group = open_group(master_address, master_port, 0, world_size, group_name, backend,
                                timeout_s)

    @staticmethod
    def spec(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], list[str], list[list[int]]]:
        """(names, dtype names, shapes) of ``named``, as the engines' call takes them."""
        names, dtypes, shapes = [], [], []
        for name, tensor in named:
            names.append(name)
            dtypes.append(str(tensor.dtype).removeprefix("torch."))
            shapes.append(list(tensor.shape))
        return names, dtypes, shapes

    def send(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Broadcast each tensor (made contiguous) in order; returns the bytes sent."""
        total = 0
        for _, tensor in named:
            tensor = tensor.detach().contiguous()
            broadcast(self.group, tensor)
            total += tensor.numel() * tensor.element_size()
        return total

    def close(self) -> None:
        """Leave the group (its threads stop; call before the process exits)."""
        close_group(self.group)
        self.group = None
