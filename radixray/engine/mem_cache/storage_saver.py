"""The bytes behind a model runner's weights and KV pool, freed and restored by tag.

How the bytes go: ``tensor.untyped_storage().resize_(0)`` on every distinct storage
(the way FSDP frees parameters). The tensor objects, their shapes and every view of
them (tied embeddings, parameters packed into one huge-page buffer, the KV pool's
per-layer tensors held by the attention backend) stay valid; only the memory under
them goes, and ``resize_(n)`` gives them new memory later. That keeps object
identity, which is what SGLang's memory saver keeps by holding on to virtual
addresses; the raw addresses do change on resume, so anything that captured them
(the decode CUDA graphs) is captured again (``ModelRunner.weights_moved``). CPU
storages of 32 MiB and more come from mmap and go straight back to the kernel;
smaller ones go back to glibc's arenas, and ``malloc_trim`` then returns their pages
(all but up to glibc's trim threshold at the top of a thread's arena). CUDA memory
goes back to the driver through ``torch.cuda.empty_cache``.

What happens to the content:

- ``weights`` keep it. Before their storages are freed the bytes are spilled: on CPU
  to an unnamed temporary file under ``<cache_dir>/spill`` (the page cache holds it
  while memory is plentiful and the kernel can write it to disk and evict it when
  the trainer needs the RAM: keeping a second copy in process memory would free
  nothing); on CUDA to CPU memory. Resume allocates the storages again, advises
  huge pages on the untouched CPU memory (as at load time), reads the bytes back
  and closes the file (which deletes it). Weights must not be updated while released.
- ``kv_cache`` does not: the caller (MemorySaver) first flushes the radix cache, so no
  request and no cached prefix refers to a slot. Resume allocates the pool again and
  zero-fills it, which faults every page in at once (a memory shortfall shows at
  resume, not in the middle of a step) and keeps padding slot 0 finite. On CPU the
  pool is advised for huge pages first, as at start-up; the kernel may then have to
  compact memory to find them, which is most of a large pool's resume time.

:class:`StorageSaver` is that mechanism alone, for one runner: the engine's MemorySaver
(memory_saver.py) adds the scheduler's checks around it, and a tensor-parallel follower
(engine/tp/) runs one of its own when the driver relays a release.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import IO

import torch

from radixray.engine.allocator import trimming
from radixray.engine.mem_cache.hugepages import advise_huge_pages

logger = logging.getLogger(__name__)

_IO_CHUNK = 1 << 30  # bytes per pwrite/preadv call (Linux moves at most ~2 GiB per call)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage``: no copy."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


_PyBUF_WRITE = 0x200
_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_memory_view.restype = ctypes.py_object


def _host_buffer(storage: torch.UntypedStorage) -> memoryview:
    """A writable memoryview over a CPU storage's bytes, for the spill file's reads and writes.

    Not ``tensor.numpy()``: that marks the storage not resizable for good. Valid only
    while the storage keeps its current allocation."""
    return _memory_view(storage.data_ptr(), storage.nbytes(), _PyBUF_WRITE)


def _distinct_storages(tensors) -> list[torch.UntypedStorage]:
    """The storages under ``tensors``, each once (views and tied tensors share one), in first-seen
    order; empty ones and ones that cannot be resized (memory-mapped files) are left out."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            if not storage.resizable():
                logger.warning("memory saver: a %.1f MiB storage is not resizable (mapped file?); "
                               "it stays", storage.nbytes() / 2**20)
                continue
            seen[storage.data_ptr()] = storage
    return list(seen.values())


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:done + _IO_CHUNK], offset + done)


def _pread_all(fd: int, into: memoryview, offset: int) -> None:
    done = 0
    while done < len(into):
        n = os.preadv(fd, [into[done:done + _IO_CHUNK]], offset + done)
        if n == 0:
            raise OSError(f"spill file ended {len(into) - done} bytes early")
        done += n


@dataclass
class _Released:
    """One tag's freed storages and their sizes, plus (weights) where their bytes wait."""

    storages: list[torch.UntypedStorage]
    sizes: list[int]
    spill_file: IO[bytes] | None = None  # CPU weights: unnamed temp file, storage i at offsets[i]
    offsets: list[int] = field(default_factory=list)
    copies: list[torch.Tensor | None] = field(default_factory=list)  # CUDA weights: CPU bytes
    # weights: per storage, whether a full weight update replaces it (parameters, int8
    # buffers) rather than needing its bytes back (the rotary tables)
    replaceable: list[bool] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


def _subset(rel: _Released, pick: list[bool]) -> _Released:
    """The storages of ``rel`` where ``pick`` is true, sharing its spill file and copies."""
    idx = [i for i, p in enumerate(pick) if p]
    return _Released([rel.storages[i] for i in idx], [rel.sizes[i] for i in idx],
                     rel.spill_file, [rel.offsets[i] for i in idx],
                     [rel.copies[i] for i in idx])


def _malloc_trim() -> None:
    """glibc's ``malloc_trim(0)``: give every arena's free pages back to the kernel (no-op
    elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        pass


def spill_dir() -> str:
    """Where CPU weights wait while released: ``<cache_dir>/spill``."""
    from radixray.engine.weights.loader import cache_dir
    return os.path.join(cache_dir(), "spill")



class StorageSaver:
    """Frees and restores the storages of ``runner``'s weights and KV pool by tag;
    ``released`` is the set of released tags (shared with the caller's)."""

    def __init__(self, runner, released: set[str] | None = None):
        self.runner = runner
        self.released: set[str] = set() if released is None else released
        self.state: dict[str, _Released] = {}

    def release(self, tags: list[str]) -> list[_Released]:
        """Free ``tags``' storages (the weights spilled first; the KV pool must hold nothing
        anyone needs). Nothing is freed when spilling fails."""
        state: dict[str, _Released] = {}
        if "weights" in tags:
            state["weights"] = self._spill_weights()
        if "kv_cache" in tags:
            pool = self.runner.kv_pool
            storages = _distinct_storages(pool.k_buffers + pool.v_buffers)
            state["kv_cache"] = _Released(storages, [st.nbytes() for st in storages])
        if "cuda_graph" in tags:  # no storages: the graphs and their memory pool go
            state["cuda_graph"] = _Released([], [self._release_graphs()])
        with trimming():  # freed at an arena's top: returned now (engine/allocator.py)
            for tag in tags:
                for storage in state[tag].storages:
                    storage.resize_(0)
            self._return_freed_memory(state.values())
        self.state.update(state)
        self.released.update(tags)
        return [state[t] for t in tags]

    def resume(self, tags: list[str]) -> list[_Released]:
        """Allocate ``tags``' storages again and fill them (weights: their bytes; KV: zeros).
        All or nothing: if allocating fails the tags stay released."""
        state = [self.state[tag] for tag in tags]
        grown: list[torch.UntypedStorage] = []
        try:
            for rel in state:
                for storage, n in zip(rel.storages, rel.sizes):
                    storage.resize_(n)
                    grown.append(storage)
            for tag, rel in zip(tags, state):
                self._fill(tag, rel)
        except BaseException:
            for storage in grown:  # all or nothing: the tags stay released, the spill stays
                storage.resize_(0)
            raise
        for tag, rel in zip(tags, state):
            if tag == "cuda_graph" and self.runner.decode_graphs is not None:
                self.runner.decode_graphs.resume()  # captured again at the next decode step
            if rel.spill_file is not None:
                rel.spill_file.close()  # unnamed file: closing deletes it
            del self.state[tag]
            self.released.discard(tag)
        return state

    def replaced(self) -> bool:
        """A full weight update replaced the released weights (its commit gave every
        parameter and int8 buffer new memory): read back only what the update did not
        replace, drop the spill, and the weights are no longer released. False (nothing
        done) when the weights are not released."""
        rel = self.state.get("weights")
        if rel is None:
            return False
        keep = _subset(rel, [not r for r in rel.replaceable])
        for storage, n in zip(keep.storages, keep.sizes):
            storage.resize_(n)
        self._fill("weights", keep)
        if rel.spill_file is not None:
            rel.spill_file.close()
        del self.state["weights"]
        self.released.discard("weights")
        logger.info("released weights replaced by a weight update (%.1f MiB never read back)",
                    sum(n for n, r in zip(rel.sizes, rel.replaceable) if r) / 2**20)
        return True

    def _spill_weights(self) -> _Released:
        """Save every weight storage's bytes (CPU: one unnamed file; CUDA: CPU copies)."""
        from radixray.kernels.int8_linear import Int8Linear
        model = self.runner.model
        storages = _distinct_storages(itertools.chain(model.parameters(), model.buffers()))
        int8 = [b for m in model.modules() if isinstance(m, Int8Linear)
                for b in m.buffers(recurse=False) if b is not None]
        updated = {st.data_ptr() for st in _distinct_storages(itertools.chain(model.parameters(),
                                                                               int8))}
        rel = _Released(storages, [st.nbytes() for st in storages],
                        replaceable=[st.data_ptr() in updated for st in storages])
        on_cpu = [st.device.type == "cpu" for st in storages]
        if any(on_cpu):
            os.makedirs(spill_dir(), exist_ok=True)
            rel.spill_file = tempfile.TemporaryFile(dir=spill_dir(), prefix="weights-")
        try:
            offset = 0
            for storage, cpu in zip(storages, on_cpu):
                if cpu:
                    rel.offsets.append(offset)
                    _pwrite_all(rel.spill_file.fileno(), _host_buffer(storage), offset)
                    offset += storage.nbytes()
                    rel.copies.append(None)
                else:
                    copy = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)
                    copy.copy_(_bytes_of(storage), non_blocking=True)
                    rel.offsets.append(-1)
                    rel.copies.append(copy)
            if not all(on_cpu):
                torch.cuda.synchronize()
        except BaseException:
            if rel.spill_file is not None:
                rel.spill_file.close()
            raise
        return rel

    def _release_graphs(self) -> int:
        """Drop the runner's decode CUDA graphs (decode runs eagerly until resumed); the
        device memory that returned (0 without graphs)."""
        graphs = self.runner.decode_graphs
        if graphs is None:
            return 0
        before = torch.cuda.memory_reserved(self.runner.device)
        graphs.release()
        return max(0, before - torch.cuda.memory_reserved(self.runner.device))

    @staticmethod
    def _fill(tag: str, rel: _Released) -> None:
        """Fill freshly allocated storages: the weights' saved bytes, or zeros for the KV pool."""
        cuda = False
        for i, storage in enumerate(rel.storages):
            data = _bytes_of(storage)
            advise_huge_pages(data)  # CPU only; the new memory is still untouched here
            if tag == "kv_cache":
                data.zero_()
            elif rel.copies[i] is not None:
                data.copy_(rel.copies[i], non_blocking=True)
                cuda = True
            else:
                _pread_all(rel.spill_file.fileno(), _host_buffer(storage), rel.offsets[i])
        if cuda:
            torch.cuda.synchronize()

    @staticmethod
    def _return_freed_memory(released) -> None:
        """Make sure freed bytes leave the process: torch's CUDA caching allocator keeps
        them until ``empty_cache``; glibc keeps freed chunks below its mmap threshold
        (which rises to the size of the last mmapped chunk freed, up to 32 MiB) in its
        arenas until ``malloc_trim``."""
        devices = {st.device.type for rel in released for st in rel.storages}
        if "cuda" in devices:
            torch.cuda.empty_cache()
        if "cpu" in devices:
            _malloc_trim()
