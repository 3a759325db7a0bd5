"""This engine's place in an expert-parallel group, and the lockstep its scheduler keeps.

An expert-parallel (EP) group is ``ep_size`` engines (ranks), one process each, joined
by a torch.distributed process group (gloo on CPU, NCCL on GPU). Attention is
data-parallel: each rank has its own requests, KV pool and radix cache and schedules
them itself. The MoE layers are shared: each rank holds a share of the experts, and a
forward pass exchanges tokens with every other rank in each MoE layer
(``engine/ep/dispatch.py``). So the ranks must run their forward passes together, one
for one:

- before every scheduler step the ranks agree whether any of them has work, whether
  any is stopping, and whether any wants an expert rebalance
  (:meth:`ExpertParallelGroup.agree`, one small all-reduce; one rank stopping stops the
  group; a rebalance then runs on every rank before the step, ``engine/ep/eplb.py``);
- if any has, every rank steps; a rank whose step ran no forward pass (no request, or
  none admissible) runs an idle one (:meth:`ModelRunner.forward_idle`: each MoE layer's
  exchange with zero tokens), so every rank calls the same collectives in the same order;
- while no rank has work, each waits for requests a short while between agreements.

Every collective has a timeout (``ep_timeout_s``): a rank that died or hangs makes the
others fail their step instead of waiting forever, and the group is restarted as a unit.
"""

from __future__ import annotations

import datetime
import logging
import socket

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.01  # how long an idle group waits for requests between two agreements


class ExpertParallelGroup:
    """Join (or hold) the EP process group of ``size`` ranks as ``rank``.

    ``init_method``: ``tcp://host:port`` of rank 0's rendezvous. ``backend``: ``gloo``
    or ``nccl``. The group is the default (world) group of this process, which holds
    nothing but this engine.
    """

    def __init__(self, rank: int, size: int, init_method: str, backend: str = "gloo",
                 timeout_s: float = 300.0):
        if not 0 <= rank < size:
            raise ValueError(f"ep_rank must be in [0, ep_size={size}), got {rank}")
        import torch
        import torch.distributed as dist
        self.rank, self.size, self.backend = rank, size, backend
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=init_method, rank=rank,
                                    world_size=size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self.group = None  # the world group
        device = "cuda" if backend == "nccl" else "cpu"
        self.device = device
        self._flags = torch.zeros(3, dtype=torch.int32, device=device)
        self.agreements = 0  # all-reduces of the step lockstep (a benchmark reads them)
        logger.info("expert-parallel rank %d of %d joined (%s, %s)", rank, size, backend,
                    init_method)

    def agree(self, has_work: bool, stopping: bool,
              rebalance: bool = False) -> tuple[bool, bool, bool]:
        """(whether any rank has work this turn, whether any rank is stopping, whether any
        wants an expert rebalance); every rank calls it once per scheduler turn. A stopping
        rank stops the whole group, so no rank is left waiting in a collective for a peer
        that has gone."""
        import torch.distributed as dist
        self._flags[0], self._flags[1], self._flags[2] = int(has_work), int(stopping), int(rebalance)
        dist.all_reduce(self._flags, op=dist.ReduceOp.MAX, group=self.group)
        self.agreements += 1
        work, stop, rebalance = self._flags.tolist()
        return bool(work), bool(stop), bool(rebalance)

    def any_of(self, *flags: bool) -> list[bool]:
        """Each flag or-ed over the ranks (every rank calls it with as many flags)."""
        import torch
        import torch.distributed as dist
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(x) for x in t.tolist()]

    def total(self, counts):
        """``counts`` (an int64 CPU tensor of the same shape on every rank) summed over the
        ranks; a new tensor on the CPU."""
        import torch.distributed as dist
        t = counts.to(self.device, copy=True)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t.cpu()

    def close(self) -> None:
        import torch.distributed as dist
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer already gone
                pass


def join_ep_group(config, rank: int, init_method: str | None) -> ExpertParallelGroup | None:
    """This engine's group when ``config.ep_size`` > 1 (None otherwise); ValueError naming
    the field when the rank or the rendezvous is missing."""
    if config.ep_size == 1:
        return None
    if init_method is None:
        raise ValueError(f"ep_size={config.ep_size} needs ep_rank and ep_init_method for each "
                         f"rank (radixray serve --ep-size N starts the ranks as a group)")
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    return ExpertParallelGroup(rank, config.ep_size, init_method, backend, config.ep_timeout_s)


def free_tcp_address(host: str = "127.0.0.1") -> str:
    """``tcp://host:port`` with a port free on ``host`` now: a group's rendezvous (rank 0
    listens there; a port taken meanwhile fails the group's start with a clear error)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return f"tcp://{host}:{sock.getsockname()[1]}"
