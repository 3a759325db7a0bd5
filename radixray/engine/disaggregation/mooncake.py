"""The KV transport: Mooncake's TransferEngine, one per engine process.

Each engine registers its KV pool buffers; the prefill side writes into the decode side's
registered buffers with one-sided batched writes addressed by the peer's session
(``host:rpc_port``). ``protocol`` is ``tcp`` here; ``rdma`` on clusters with RDMA NICs is
the same code. Imported lazily: only prefill and decode engines need the wheel
(``mooncake-transfer-engine-non-cuda`` on CPU machines, with Debian's ``libibverbs1``).
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("radixray.pd")

MAX_SPANS_PER_BATCH = 1024  # Mooncake refuses larger batches (returns -1)


class TransferError(RuntimeError):
    """A KV write did not complete (peer gone, address not registered, network error)."""


class MooncakeTransport:
    """A started TransferEngine listening on ``host`` (its rpc port picked by Mooncake)."""

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device: str = ""):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise RuntimeError(
                "prefill-decode disaggregation needs Mooncake's transfer engine: pip install "
                "mooncake-transfer-engine-non-cuda (CPU machines; needs Debian's libibverbs1) or "
                f"mooncake-transfer-engine (CUDA): {exc}") from None
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, "
                               f"{protocol!r}) failed with {rc}")
        self.host, self.protocol = host, protocol
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def register(self, addr: int, length: int) -> None:
        """Make ``length`` bytes at ``addr`` readable and writable by peers."""
        rc = self._engine.register_memory(addr, length)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory({addr:#x}, {length}) failed with {rc}")
        self._registered.append((addr, length))

    def unregister(self, addr: int) -> None:
        """Stop exposing the region registered at ``addr`` (before it is freed); nothing
        when it is not registered (any more: :meth:`close` unregisters everything)."""
        with self._lock:  # not while a batch may read it
            if not any(a == addr for a, _ in self._registered):
                return
            self._registered = [r for r in self._registered if r[0] != addr]
            rc = self._engine.unregister_memory(addr)
        if rc != 0:
            raise RuntimeError(f"Mooncake unregister_memory({addr:#x}) failed with {rc}")

    def write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """Write each ``lengths[i]`` bytes from local ``src[i]`` to ``dst[i]`` at peer
        ``session``, in batches of up to MAX_SPANS_PER_BATCH spans; returns when all landed,
        raises TransferError otherwise (spans of earlier batches may have landed)."""
        for at in range(0, len(src), MAX_SPANS_PER_BATCH):
            part = slice(at, at + MAX_SPANS_PER_BATCH)
            with self._lock:  # one batch at a time per engine (the sender thread and probes)
                rc = self._engine.batch_transfer_sync_write(session, src[part], dst[part],
                                                            lengths[part])
            if rc != 0:
                raise TransferError(
                    f"KV write of {len(src[part])} span(s), {sum(lengths[part])} bytes to "
                    f"{session} failed (Mooncake returned {rc}; is the peer alive and are "
                    f"its buffers registered?)")

    def close(self) -> None:
        for addr, _ in self._registered:
            try:
                self._engine.unregister_memory(addr)
            except Exception:  # noqa: BLE001 - closing must not raise
                pass
        self._registered.clear()
