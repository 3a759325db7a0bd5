"""The page table GPU attention kernels read: each request's KV slots as one flat CSR list.

The pool is paged with one token per page (a slot is a page), so a request's pages are the
first ``n`` cells of its row in the request table. :func:`page_table` packs those cells of
every request of a batch into ``indices`` with ``indptr`` (request ``b``'s pages are
``indices[indptr[b]:indptr[b + 1]]``), the layout flashinfer and the triton kernels take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAGE_SIZE = 1  # tokens per page of the engine's pool (engine/mem_cache/pool.py)


@dataclass(frozen=True)
class PageTable:
    """``indptr`` ``[B + 1]`` and ``indices`` ``[sum(lens)]`` (int32, on the pool's device),
    and the token counts ``lens`` ``[B]`` (int32, same device)."""

    indptr: torch.Tensor
    indices: torch.Tensor
    lens: torch.Tensor


def page_table(req_to_token: torch.Tensor, rows: torch.Tensor, lens: list[int],
               device: torch.device) -> PageTable:
    """The first ``lens[b]`` slots of request table row ``rows[b]``, for each ``b``, packed
    (request order, then position order). A length may be 0."""
    lens_t = torch.tensor(lens, dtype=torch.int32)
    indptr = _cumulative(lens_t)
    width = max(lens, default=0)
    if width:
        cells = req_to_token[rows, :width]
        indices = cells[torch.arange(width)[None, :] < lens_t[:, None]].to(torch.int32)
    else:
        indices = torch.zeros(0, dtype=torch.int32)
    return PageTable(indptr.to(device), indices.to(device), lens_t.to(device))


def indptr_of(lens: list[int], device: torch.device) -> torch.Tensor:
    """``[0, lens[0], lens[0] + lens[1], ...]`` (int32) on ``device``: where each request's
    rows start in a packed batch (e.g. ``qo_indptr`` from an extend batch's new tokens)."""
    return _cumulative(torch.tensor(lens, dtype=torch.int32)).to(device)


def _cumulative(lens: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lens.numel() + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=out[1:])
    return out


def as_pages(buffer: torch.Tensor) -> torch.Tensor:
    """A pool buffer ``[slots, kv_heads, head_dim]`` as pages ``[slots, 1, kv_heads,
    head_dim]`` (a view)."""
    return buffer.unsqueeze(1)


class StaticPageTable:
    """A page table in buffers whose addresses never change, for captured decode steps
    (engine/executor/cuda_graph.py): up to ``max_bs`` requests over a pool of
    ``pool_slots`` slots (each slot once, plus one padding slot per row)."""

    def __init__(self, max_bs: int, pool_slots: int, device: torch.device):
        self.indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.indices = torch.zeros(pool_slots + max_bs, dtype=torch.int32, device=device)
        self.lens = torch.zeros(max_bs, dtype=torch.int32, device=device)

    def fill(self, req_to_token: torch.Tensor, rows: torch.Tensor, lens: list[int]) -> PageTable:
        """Copy the page table of ``rows`` (``bs = len(lens)`` of them) into the buffers;
        returns it as views of them."""
        bs = len(lens)
        table = page_table(req_to_token, rows, lens, torch.device("cpu"))
        self.indptr[:bs + 1].copy_(table.indptr, non_blocking=True)
        self.indices[:table.indices.numel()].copy_(table.indices, non_blocking=True)
        self.lens[:bs].copy_(table.lens, non_blocking=True)
        return PageTable(self.indptr[:bs + 1], self.indices, self.lens[:bs])
