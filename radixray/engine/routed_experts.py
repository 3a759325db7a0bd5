"""The experts a MoE model's routers chose for one request's tokens (``return_routed_experts``).

What a request gets back (``meta_info["routed_experts"]``): for each token the
model computed *for this request*, in position order, one list per MoE layer of
the router's top-k logical expert ids (descending routing weight). The tokens
are positions ``routed_experts_start .. prompt_tokens + completion_tokens - 2``:

- ``routed_experts_start`` is the first position this request computed, the cached
  prefix length (``cached_tokens``): a prefix reused from the radix cache, or sent
  by a prefill worker, was computed for another request and is not included;
- the last output token is never fed through the model (generation ends after
  sampling it), so it has no routing.

Recomputed tokens replace the old ones: a retracted request that runs again from
position ``p`` keeps what it had before ``p`` (when contiguous) and records the
rest anew.
"""

from __future__ import annotations

import torch


class RoutedExpertsRecord:
    """Top-k logical expert ids ``[n, MoE layers, k]`` for positions ``start .. start + n - 1``."""

    def __init__(self):
        self.start = 0
        self._chunks: list[torch.Tensor] = []
        self._len = 0

    def add(self, position: int, ids: torch.Tensor) -> None:
        """Ids of the tokens at ``position ..`` (``ids`` ``[n, layers, k]``, on the CPU)."""
        end = self.start + self._len
        if not self._chunks or position < self.start or position > end:
            self.start, self._chunks, self._len = position, [], 0
        elif position < end:  # a recomputation: drop what it replaces
            kept = torch.cat(self._chunks)[: position - self.start]
            self._chunks, self._len = [kept], kept.shape[0]
        self._chunks.append(ids)
        self._len += ids.shape[0]

    def __len__(self) -> int:
        return self._len

    def to_list(self) -> list[list[list[int]]]:
        """``[token][moe layer][k]`` plain ints."""
        return torch.cat(self._chunks).tolist() if self._chunks else []


def record_routes(batch) -> None:
    """Hand each capturing request of ``batch`` (a ForwardBatch after the forward pass) its
    rows of ``batch.routed_experts``."""
    routes = batch.routed_experts
    if routes is None:
        return
    routes = routes.to("cpu", torch.int32)
    for req, row, n, position in batch.route_captures:
        if req.routed_experts is None:
            req.routed_experts = RoutedExpertsRecord()
        req.routed_experts.add(position, routes[row:row + n])
