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

With the engine option ``enable_return_routed_experts`` the cached prefix is covered too
(``routed_experts_start`` is 0), what RL on MoE models needs to replay a rollout's routing
in training: :class:`SlotRoutes` keeps every forward pass's choices by KV slot, so the
tokens of a prefix computed for an earlier request still carry their routes, and a
finishing request reads the routes of all its tokens from its slots before they are
released. Cost: one row copy per computed token per pass into a host table of
``pool slots x MoE layers x k`` small ints.
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

    @classmethod
    def whole(cls, ids: torch.Tensor) -> RoutedExpertsRecord:
        """A record of ``ids`` ``[n, layers, k]`` for positions ``0 .. n - 1``."""
        record = cls()
        record.add(0, ids)
        return record

    def __len__(self) -> int:
        return self._len

    def to_list(self) -> list[list[list[int]]]:
        """``[token][moe layer][k]`` plain ints."""
        return torch.cat(self._chunks).tolist() if self._chunks else []


def record_routes(batch) -> None:
    """Hand each capturing request of ``batch`` (a ForwardBatch after the forward pass) its
    rows of ``batch.routed_experts``."""
    routes = batch.routed_experts
    if routes is None or not batch.route_captures:
        return
    routes = routes.to("cpu", torch.int32)
    for req, row, n, position in batch.route_captures:
        if req.routed_experts is None:
            req.routed_experts = RoutedExpertsRecord()
        req.routed_experts.add(position, routes[row:row + n])


class SlotRoutes:
    """The routers' top-k logical expert ids ``[layers, k]`` of the token held in each KV slot
    (``enable_return_routed_experts``): written after every forward pass for the slots it
    filled, read for a request's slots when it finishes. A slot's row is valid while the
    slot holds that token's KV (the request or the radix cache holds it)."""

    def __init__(self, num_slots: int, num_layers: int, top_k: int, num_experts: int):
        dtype = torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32
        self.table = torch.zeros(num_slots, num_layers, top_k, dtype=dtype)

    def write(self, slots: torch.Tensor, routes: torch.Tensor) -> None:
        """``routes`` ``[T, layers, k]`` of the tokens written to ``slots`` ``[T]``."""
        self.table[slots.cpu()] = routes.to("cpu", self.table.dtype)

    def collect(self, req, slots: torch.Tensor) -> None:
        """``req`` finishes holding ``slots`` (its positions ``0 .. len(slots) - 1``): its record
        becomes the routes of all of them, cached prefix included."""
        req.routed_experts = RoutedExpertsRecord.whole(self.table[slots.cpu()].to(torch.int32))
