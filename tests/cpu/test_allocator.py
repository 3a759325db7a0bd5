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


def _run(script: str, **env: str) -> str:
    """``script``'s output in a new interpreter, without the user's allocator settings."""
    full = {k: v for k, v in os.environ.items()
            if k not in ("RADIXRAY_KEEP_FREED_MEMORY", "GLIBC_TUNABLES")}
    return subprocess.run([sys.executable, "-c", script], env={**full, **env}, check=True,
                          capture_output=True, text=True, timeout=120).stdout


def _probe(**env: str) -> tuple[bool, int]:
    out = _run(PROBE, **env).split()
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


# On a thread of its own (its own arena), a 20 MiB block is freed, so the arena's top holds
# 20 MiB of resident free memory, and taken again (no new page): the block a KV buffer is
# when it was carved from a top that an earlier pass left. Freed inside ``trimming`` and
# followed by ``malloc_trim``, as the memory saver's release does, it must leave the process.
# Prints the MiB the resident set fell by.
TOP_PROBE = """
import ctypes, threading
from radixray.engine.allocator import keep_freed_memory, trimming
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))
assert keep_freed_memory()
fell = []
def work():
    size = 20 << 20
    libc.malloc(1000)
    first = libc.malloc(size)
    ctypes.memset(first, 1, size)
    libc.free(first)
    block = libc.malloc(size)
    ctypes.memset(block, 2, size)
    before = rss()
    with trimming():
        libc.free(block)
        libc.malloc_trim(0)
    fell.append((before - rss()) >> 20)
thread = threading.Thread(target=work)
thread.start()
thread.join()
print(fell[0])
"""


def test_a_block_freed_at_an_arenas_top_leaves_the_process_inside_trimming():
    """``malloc_trim`` alone leaves a thread arena's top resident under the pinned trim
    threshold (glibc 2.36 here: 0 MiB fell); freed inside ``trimming`` it goes."""
    assert int(_run(TOP_PROBE)) >= 19
