"""glibc's thresholds pinned at engine start (engine/allocator.py): a block under 32 MiB comes
from the arenas (kept when freed) instead of a mapping of its own, unless the user said
otherwise (``RADIXRAY_KEEP_FREED_MEMORY=0``, or malloc tunables in ``GLIBC_TUNABLES``).

Each case runs in a new interpreter: the thresholds are per process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from radixray.engine import allocator

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")

# malloc a 30 MiB block (above glibc's initial 128 KiB mmap threshold, below the pinned 32
# MiB) and print whether the thresholds were pinned and how many bytes mappings of their own
# gained (mallinfo2's hblkhd)
PROBE = """
import ctypes
from radixray.engine.allocator import keep_freed_memory
FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
          "fordblks", "keepcost")
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
pinned = keep_freed_memory()
assert keep_freed_memory() == pinned  # once per process, the same answer
before = libc.mallinfo2().hblkhd
block = libc.malloc(30 << 20)
mapped = libc.mallinfo2().hblkhd - before
libc.free(block)
print(pinned, mapped)
"""


def _probe(**env: str) -> tuple[bool, int]:
    full = {k: v for k, v in os.environ.items()
            if k not in ("RADIXRAY_KEEP_FREED_MEMORY", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**full, **env}, check=True,
                         capture_output=True, text=True, timeout=120).stdout.split()
    return out[0] == "True", int(out[1])


def test_pinned_thresholds_serve_a_large_block_from_the_arenas():
    pinned, mapped = _probe()
    assert pinned and mapped == 0


def test_switched_off_the_block_is_mapped_apart():
    pinned, mapped = _probe(RADIXRAY_KEEP_FREED_MEMORY="0")
    assert not pinned and mapped >= 30 << 20


def test_the_users_glibc_tunables_win():
    pinned, mapped = _probe(GLIBC_TUNABLES="glibc.malloc.mmap_threshold=1048576")
    assert not pinned and mapped >= 30 << 20


def test_the_engine_pins_them_at_start(eng):
    """The in-process engine of these tests called it (this process is glibc's)."""
    assert allocator._pinned is True
