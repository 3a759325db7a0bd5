"""glibc's allocator told to keep the memory a forward pass frees, for the next one.

A prefill chunk's activations are tens of megabytes each (a 2,048-row gate|up output in
fp32 is 25 MB). By default glibc maps a block that large on its own (``mmap``) and unmaps
it when freed, and it returns the free top of a heap to the kernel once it passes 128 KiB;
the next pass then takes a page fault for each 4 KiB page it writes. On a 2-vCPU EPYC one
LoRA prefill of 32 x 512 tokens took from 0 to 1.42 million minor faults (up to 2.46 s of
system time) depending on where glibc's adaptive threshold had drifted; with the
thresholds pinned it took none, and the prefill ran ~9% faster (docs/benchmarks.md, "page
faults of fresh activations").

:func:`keep_freed_memory` pins them once per process, through ``mallopt``:

- ``M_MMAP_THRESHOLD`` 32 MiB (glibc's largest): blocks up to that come from the arenas,
  which keep them when freed. Larger ones (the KV pool, weights) are still mapped apart,
  and unmapping them still returns their memory.
- ``M_TRIM_THRESHOLD`` 1 GiB and ``M_TOP_PAD`` 64 MiB: an arena keeps up to that much free
  memory at its top instead of trimming it after every free.

The cost is resident memory: a process keeps its largest pass's activations after the
pass ends. The memory saver's release (mem_cache/storage_saver.py) frees its storages
inside :func:`trimming` and then calls ``malloc_trim``. ``malloc_trim`` alone would not do:
it returns the free pages inside an arena's heaps, but not the free top of a thread's
arena (a heap of up to 64 MiB), which a pinned trim threshold lets grow resident; a KV
buffer carved from such a top and freed there would stay in the process.
``RADIXRAY_KEEP_FREED_MEMORY=0`` leaves glibc's defaults, as does a ``GLIBC_TUNABLES``
that sets any ``glibc.malloc`` tunable itself (the user's choice wins). Elsewhere than
glibc it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
from collections.abc import Iterator

logger = logging.getLogger(__name__)

# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum for M_MMAP_THRESHOLD on 64-bit hosts
TRIM_THRESHOLD_BYTES = 1 << 30
TOP_PAD_BYTES = 64 << 20
DEFAULT_TRIM_THRESHOLD_BYTES = 128 << 10  # glibc's

_pinned: bool | None = None  # once per process: the outcome of the first call


def keep_freed_memory() -> bool:
    """Pin glibc's thresholds as the module docstring says, once per process; True when
    they are pinned (now or by an earlier call), False when left alone (not glibc,
    switched off, or ``GLIBC_TUNABLES`` sets malloc tunables)."""
    global _pinned
    if _pinned is None:
        _pinned = _pin()
    return _pinned


def _pin() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    if os.environ.get("RADIXRAY_KEEP_FREED_MEMORY", "1") == "0":
        logger.info("glibc allocator left at its defaults (RADIXRAY_KEEP_FREED_MEMORY=0)")
        return False
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        logger.info("glibc allocator left as GLIBC_TUNABLES sets it")
        return False
    mallopt = _mallopt()
    if mallopt is None:
        return False
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
                (M_TOP_PAD, TOP_PAD_BYTES))
    if not all(mallopt(param, value) == 1 for param, value in settings):
        logger.warning("glibc's mallopt refused the allocator thresholds; freed activations "
                       "go back to the kernel and are faulted in again on the next pass")
        return False
    logger.info("glibc allocator keeps freed memory: blocks up to %d MiB from its arenas, "
                "up to %d MiB free kept at an arena's top (RADIXRAY_KEEP_FREED_MEMORY=0 to "
                "leave the defaults)", MMAP_THRESHOLD_BYTES >> 20, TRIM_THRESHOLD_BYTES >> 20)
    return True


@contextlib.contextmanager
def trimming() -> Iterator[None]:
    """glibc's default trim threshold (128 KiB) and top pad (0) for the block, the pinned
    values again after it (nothing changes where :func:`keep_freed_memory` pinned nothing):
    what the block frees at an arena's top goes back to the kernel as it is freed."""
    if not _pinned:
        yield
        return
    mallopt = _mallopt()
    mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD_BYTES)
    mallopt(M_TOP_PAD, 0)
    try:
        yield
    finally:
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
        mallopt(M_TOP_PAD, TOP_PAD_BYTES)


def _mallopt():
    """glibc's ``mallopt(param, value)``, or None elsewhere (musl has none)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return mallopt
