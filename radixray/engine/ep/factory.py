"""Choosing an expert dispatcher by the ``ep_dispatch_backend`` name (DeepEP imported only
when asked for, so the engine imports without it)."""

from __future__ import annotations

import torch.distributed as dist

from radixray.engine.ep.dispatch import CollectivesExperts
from radixray.engine.models.experts import ExpertDispatcher, LocalExperts
from radixray.kernels.cpu_ops import CpuKernels

EP_DISPATCH_BACKENDS = ("local", "collectives", "deepep")


def make_expert_dispatcher(backend: str, num_physical: int, hidden_size: int,
                           intermediate_size: int, kernels: CpuKernels, rank: int = 0,
                           world_size: int = 1, group: dist.ProcessGroup | None = None,
                           low_latency: bool = False,
                           num_max_dispatch_tokens_per_rank: int = 128) -> ExpertDispatcher:
    """The expert dispatcher named by ``ep_dispatch_backend``.

    - ``local``: every slot in this process (``world_size`` must be 1).
    - ``collectives``: :class:`CollectivesExperts` over ``group``.
    - ``deepep``: ``ep_deepep.DeepEPExperts`` (CUDA + DeepEP; ``low_latency`` and
      ``num_max_dispatch_tokens_per_rank`` apply to it only).
    """
    if backend == "local":
        if world_size != 1:
            raise ValueError(f"ep_dispatch_backend 'local' holds every expert in one process; "
                             f"with ep_size {world_size} use 'collectives' or 'deepep'")
        return LocalExperts(num_physical, hidden_size, intermediate_size, kernels)
    if backend == "collectives":
        return CollectivesExperts(num_physical, rank, world_size, hidden_size,
                                  intermediate_size, kernels, group)
    if backend == "deepep":
        from radixray.engine.ep.deepep import DeepEPExperts
        return DeepEPExperts(num_physical, rank, world_size, hidden_size, intermediate_size,
                             kernels, group, low_latency=low_latency,
                             num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank)
    raise ValueError(f"ep_dispatch_backend must be one of {list(EP_DISPATCH_BACKENDS)}, "
                     f"got {backend!r}")
