"""The storage tier (L3): KV pages under a content hash of the prefix that ends with them.

A page is ``PAGE_TOKENS`` consecutive tokens of a prefix, stored as the host tier's rows
(:meth:`HostKVPool.export`). Its key chains the hashes: ``h_i = sha256(h_{i-1} || tokens
of page i)`` with ``h_{-1} = sha256(namespace)``, so one key names the whole prefix up to
the page's end, and the namespace (model, KV layout, weight version) keeps KV of another
model or weight version from ever matching.

Backends implement :class:`StorageBackend` (``exists`` / ``get`` / ``set`` by key) and are
made by :func:`create_storage` (lazy imports: mooncake only when asked for).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from abc import ABC, abstractmethod

import torch

PAGE_TOKENS = 64


def page_hashes(namespace: str, key: list[int], num_pages: int) -> list[str]:
    """The chained keys of ``key``'s first ``num_pages`` whole pages."""
    h = hashlib.sha256(namespace.encode()).digest()
    out = []
    ids = torch.tensor(key[:num_pages * PAGE_TOKENS], dtype=torch.int64).numpy()
    for i in range(num_pages):
        h = hashlib.sha256(h + ids[i * PAGE_TOKENS:(i + 1) * PAGE_TOKENS].tobytes()).digest()
        out.append(h.hex())
    return out


class StorageBackend(ABC):
    """A key-value store of page blobs. ``set`` of a key that exists may be skipped; a
    ``get`` returns the bytes a ``set`` stored, or None when the key is absent."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def get(self, key: str) -> bytes | None: ...

    @abstractmethod
    def set(self, key: str, value: bytes) -> None: ...


class FileStorage(StorageBackend):
    """One file per page under ``root/<key[:2]>/<key>``; written to a temporary name and
    renamed, so a reader (another engine sharing the folder) never sees half a page."""

    def __init__(self, root: str):
        self.root = os.path.abspath(os.path.expanduser(root))
        os.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key[:2], key)

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def get(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def set(self, key: str, value: bytes) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
        with os.fdopen(fd, "wb") as f:
            f.write(value)
        os.replace(tmp, path)


class MooncakeStorage(StorageBackend):
    """Mooncake's distributed store (``mooncake.store``). Needs a running ``mooncake_master``
    and metadata service; their addresses come from the environment, as Mooncake's own
    clients read them: MOONCAKE_MASTER, MOONCAKE_TE_META_DATA_SERVER, MOONCAKE_PROTOCOL,
    MOONCAKE_LOCAL_HOSTNAME (a serving worker sets it to its Ray node's address unless it is
    set), MOONCAKE_GLOBAL_SEGMENT_SIZE (bytes)."""

    def __init__(self):
        from mooncake.store import MooncakeDistributedStore

        env = os.environ.get
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(env("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1"),
                              env("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
                              int(env("MOONCAKE_GLOBAL_SEGMENT_SIZE", str(512 << 20))),
                              int(env("MOONCAKE_LOCAL_BUFFER_SIZE", str(128 << 20))),
                              env("MOONCAKE_PROTOCOL", "tcp"), "",
                              env("MOONCAKE_MASTER", "127.0.0.1:50051"))
        if rc != 0:
            raise RuntimeError(f"Mooncake store setup failed (rc={rc}): is mooncake_master "
                               f"running at {env('MOONCAKE_MASTER', '127.0.0.1:50051')}?")

    def exists(self, key: str) -> bool:
        return self.store.is_exist(key) == 1

    def get(self, key: str) -> bytes | None:
        value = self.store.get(key)
        return bytes(value) if value else None

    def set(self, key: str, value: bytes) -> None:
        self.store.put(key, value)


def create_storage(backend: str | None, folder: str | None) -> StorageBackend | None:
    """The backend named by ``hicache_storage_backend`` (None: no storage tier)."""
    if backend is None:
        return None
    if backend == "file":
        if not folder:
            raise ValueError("hicache_storage_backend='file' needs hicache_storage_dir")
        return FileStorage(folder)
    if backend == "mooncake":
        return MooncakeStorage()
    raise ValueError(f"unknown hicache_storage_backend {backend!r}")
