"""The attention backend interface: one layer of a packed batch over the paged KV pool."""

from __future__ import annotations

import abc

import torch

from radixray.engine.executor.forward_batch import ForwardBatch, ForwardMode
from radixray.engine.mem_cache.pool import KVPool


class AttentionBackend(abc.ABC):
    """Computes attention for one layer of a packed batch over a paged KV pool.

    Contract: ``init_forward_metadata`` runs once per step before the first layer
    and may store per-step index tensors in ``batch.attn_metadata``. ``forward``
    writes the new keys/values of layer ``layer`` to ``batch.out_cache_loc`` and
    returns the attention output ``[T, num_heads, head_dim]``.

    A mixed batch (``batch.num_decode > 0``: decode requests riding in an extend batch)
    may be handed to ``init_mixed_metadata`` / ``forward_mixed``, which run the extend
    requests and the decode requests as the two separate batches they would have been.
    """

    name: str
    # Decode CUDA graphs (engine/executor/cuda_graph.py): a backend that supports them keeps
    # its decode metadata in static buffers (init_graph_buffers, prepare_graph).
    supports_cuda_graph = False

    def __init__(self, req_to_token: torch.Tensor, kv_pool: KVPool, scaling: float):
        self.req_to_token = req_to_token
        self.kv_pool = kv_pool
        self.scaling = scaling

    @abc.abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                batch: ForwardBatch) -> torch.Tensor: ...

    def init_mixed_metadata(self, batch: ForwardBatch) -> None:
        """Mixed batch: metadata for its extend part and its decode part, each built as for a
        batch of its own (kept in ``batch.attn_metadata["mixed_parts"]``)."""
        parts = split_mixed(batch)
        for part in parts:
            self.init_forward_metadata(part)
        batch.attn_metadata["mixed_parts"] = parts

    def forward_mixed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                      batch: ForwardBatch) -> torch.Tensor:
        """Mixed batch: the extend rows through the extend path, the decode rows through the
        decode path, so a decode request computes what it would in a decode step."""
        ext, dec = batch.attn_metadata["mixed_parts"]
        t = ext.num_tokens
        return torch.cat((self.forward(q[:t], k[:t], v[:t], layer, ext),
                          self.forward(q[t:], k[t:], v[t:], layer, dec)))


def split_mixed(batch: ForwardBatch) -> tuple[ForwardBatch, ForwardBatch]:
    """A mixed batch as (its extend requests, its ``num_decode`` decode requests), views of the
    same token tensors."""
    e = batch.batch_size - batch.num_decode
    t = sum(batch.extend_lens[:e])

    def part(mode: ForwardMode, rows: slice, reqs: slice) -> ForwardBatch:
        return ForwardBatch(
            mode=mode, input_ids=batch.input_ids[rows], positions=batch.positions[rows],
            out_cache_loc=batch.out_cache_loc[rows], req_rows=batch.req_rows[reqs],
            prefix_lens=batch.prefix_lens[reqs], extend_lens=batch.extend_lens[reqs],
            seq_lens=batch.seq_lens[reqs])

    return (part(ForwardMode.EXTEND, slice(0, t), slice(0, e)),
            part(ForwardMode.DECODE, slice(t, None), slice(e, None)))
