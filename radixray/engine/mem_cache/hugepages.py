"""Transparent huge pages for the large, long-lived tensors (weights, KV pool) on Linux CPUs.

Decode streams every weight once per step. With 4 KiB pages the hardware
prefetchers restart at every page boundary and the TLB misses constantly;
2 MiB pages remove both (measured here: about 20% off a batch-1 decode step,
docs/benchmarks.md). The kernel here only gives huge pages to memory that asks
with madvise(MADV_HUGEPAGE) before it is first touched, so the tensors are
allocated untouched, advised, then filled.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

logger = logging.getLogger(__name__)

MADV_HUGEPAGE = 14
HUGE_PAGE = 2 * 2**20

_libc = None


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc.madvise


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages over the 2 MiB-aligned part of ``t``'s storage. Call before writing it."""
    if not sys.platform.startswith("linux") or t.device.type != "cpu":
        return False
    nbytes = t.untyped_storage().nbytes()
    start = t.untyped_storage().data_ptr()
    aligned = (start + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    length = (start + nbytes - aligned) // HUGE_PAGE * HUGE_PAGE
    if length <= 0:
        return False
    return _madvise()(aligned, length, MADV_HUGEPAGE) == 0


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable, contents unchanged
PAGE = 4096


def populate_rows(buffers: list[torch.Tensor], rows_per_round: int) -> float:
    """Fault in the pages of ``buffers`` (same leading dimension) without changing their
    contents, ``rows_per_round`` rows of every buffer per round in row order, so rows are
    ready in the order an allocator hands them out. Safe while others write the buffers.
    Returns the seconds it took; 0.0 when the kernel cannot (nothing happens then)."""
    import time
    if not sys.platform.startswith("linux") or not buffers or buffers[0].device.type != "cpu":
        return 0.0
    madvise = _madvise()
    row_bytes = buffers[0][0].numel() * buffers[0].element_size()
    rows = buffers[0].shape[0]
    t0 = time.perf_counter()
    for first in range(0, rows, rows_per_round):
        n = min(rows_per_round, rows - first)
        for buf in buffers:
            start = buf.data_ptr() + first * row_bytes
            aligned = start // PAGE * PAGE
            if madvise(aligned, start + n * row_bytes - aligned, MADV_POPULATE_WRITE) != 0:
                return 0.0
    return time.perf_counter() - t0


def empty_huge(shape, dtype: torch.dtype) -> torch.Tensor:
    """An untouched CPU tensor advised for huge pages (falls back to normal pages silently)."""
    t = torch.empty(shape, dtype=dtype)
    advise_huge_pages(t)
    return t


def pack_parameters_into_huge_pages(module: torch.nn.Module) -> int:
    """Move every parameter of ``module`` into one huge-page-advised buffer; return its bytes.

    Parameters keep their identity (only ``.data`` changes), so references held
    elsewhere (tied embeddings, fused kernels) stay valid. Needs one extra copy of
    the weights in memory while it runs.
    """
    params = list(module.parameters())
    if not params or any(p.device.type != "cpu" for p in params):
        return 0
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    total = 0
    for dtype, group in by_dtype.items():
        align = 64  # elements: every parameter starts on a cache line
        sizes = [(p.numel() + align - 1) // align * align for p in group]
        flat = empty_huge(sum(sizes), dtype)
        offset = 0
        for p, size in zip(group, sizes):
            view = flat[offset:offset + p.numel()].view_as(p)
            view.copy_(p.data)
            p.data = view
            offset += size
        total += flat.numel() * flat.element_size()
    return total
