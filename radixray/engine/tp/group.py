"""This process's place in a tensor-parallel group: the collectives the sharded model calls,
and the channel the driver rank sends each step over.

A TP group is ``size`` processes (ranks) joined by torch.distributed (gloo on CPU, NCCL on
GPU; the step channel always runs over gloo, on the CPU). The model calls
:meth:`TensorParallel.all_reduce` after each row-parallel projection and
:meth:`TensorParallel.all_gather` on the vocab-parallel logits; with size 1 both return
their input, so a single-rank engine runs the same model code with no collective.

Every collective has the group's timeout (``tp_timeout_s``): a rank that died or hangs makes
the others fail instead of waiting forever.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time

import torch

logger = logging.getLogger(__name__)

CHANNEL_TIMEOUT = datetime.timedelta(days=365)


class TensorParallel:
    """Rank ``rank`` of a group of ``size`` (size 1: no group, every collective a no-op)."""

    def __init__(self, rank: int = 0, size: int = 1, group=None, channel_group=None):
        self.rank, self.size = rank, size
        self.group = group  # the collectives' process group (None: the default one)
        self.channel_group = channel_group  # gloo group of the step channel (long timeout)
        # the model's collectives so far: seconds inside them, calls, bytes each rank gave
        self.comm_seconds, self.comm_calls, self.comm_bytes = 0.0, 0, 0
        self._send_lock = threading.Lock()

    @classmethod
    def join(cls, rank: int, size: int, init_method: str, backend: str = "gloo",
             timeout_s: float = 300.0) -> TensorParallel:
        """Join the group of ``size`` ranks whose rank 0 listens at ``init_method``
        (``tcp://host:port``) as the default process group of this process."""
        if not 0 <= rank < size:
            raise ValueError(f"tp_rank must be in [0, tp_size={size}), got {rank}")
        import torch.distributed as dist
        timeout = datetime.timedelta(seconds=timeout_s)
        cls.check_joinable(size)
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=init_method, rank=rank,
                                    world_size=size, timeout=timeout)
        # the step channel: a follower waits on it as long as the driver is idle
        channel = dist.new_group(backend="gloo", timeout=CHANNEL_TIMEOUT)
        logger.info("tensor-parallel rank %d of %d joined (%s, %s)", rank, size, backend,
                    init_method)
        return cls(rank, size, None, channel)

    @staticmethod
    def check_joinable(size: int) -> None:
        """ValueError when this process is already in a torch.distributed group of another
        size (another tensor-parallel engine)."""
        import torch.distributed as dist
        if dist.is_initialized() and dist.get_world_size() != size:
            raise ValueError(
                f"this process is already in a torch.distributed group of "
                f"{dist.get_world_size()} ranks (another tensor-parallel engine): one "
                f"tensor-parallel engine of tp_size {size} per process; run it in a worker "
                f"process of its own (a fleet does)")

    @property
    def driver(self) -> bool:
        """Whether this rank schedules (rank 0) rather than follows."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (in place when ``x`` is contiguous)."""
        if self.size == 1:
            return x
        import torch.distributed as dist
        x = x.contiguous()
        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self._count(t0, x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        t0 = time.perf_counter()
        dist.all_gather(parts, x, group=self.group)
        self._count(t0, x)
        return torch.cat(parts, dim=-1)

    def _count(self, t0: float, x: torch.Tensor) -> None:
        self.comm_seconds += time.perf_counter() - t0
        self.comm_calls += 1
        self.comm_bytes += x.numel() * x.element_size()

    def min_over_ranks(self, values: list[int]) -> list[int]:
        """Each value's minimum over the ranks (every rank calls it with as many)."""
        if self.size == 1:
            return list(values)
        import torch.distributed as dist
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.channel_group)
        return t.tolist()

    def send(self, message) -> None:
        """Rank 0: send ``message`` (any picklable object) to every other rank. Thread-safe:
        steps and weight-session messages from several threads go out one at a time."""
        import torch.distributed as dist
        with self._send_lock:
            dist.broadcast_object_list([message], src=0, group=self.channel_group)

    def receive(self):
        """A follower rank: the next message rank 0 sends (waits up to the group's
        timeout)."""
        import torch.distributed as dist
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.channel_group)
        return box[0]

    def leave(self) -> None:
        import torch.distributed as dist
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


NO_TP = TensorParallel()
