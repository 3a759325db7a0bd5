"""The attention backend interface: one layer of a packed batch over the paged KV pool."""

from __future__ import annotations

import abc

import torch

from radixray.engine.forward_batch import ForwardBatch
from radixray.engine.memory import KVPool


class AttentionBackend(abc.ABC):
    """Computes attention for one layer of a packed batch over a paged KV pool.

    Contract: ``init_forward_metadata`` runs once per step before the first layer
    and may store per-step index tensors in ``batch.attn_metadata``. ``forward``
    writes the new keys/values of layer ``layer`` to ``batch.out_cache_loc`` and
    returns the attention output ``[T, num_heads, head_dim]``.
    """

    name: str

    def __init__(self, req_to_token: torch.Tensor, kv_pool: KVPool, scaling: float):
        self.req_to_token = req_to_token
        self.kv_pool = kv_pool
        self.scaling = scaling

    @abc.abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                batch: ForwardBatch) -> torch.Tensor: ...
