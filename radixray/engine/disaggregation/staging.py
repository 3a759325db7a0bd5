"""Sender-side staging of re-sliced KV rows: whole-row writes where a destination rank's row
is a piece of the source rank's row.

Without it, a piece of a row moves as one span per slot, layer and key/value buffer
(:func:`~radixray.engine.disaggregation.layout.copy_spans`), and Mooncake's TCP transport
handles every span as a transfer of its own: a prefill worker of one rank writing into a
decode worker of three moved SmolLM2's KV at 0.01 GB/s against 1.46 GB/s in whole rows.
When the destination row is exactly the piece (its heads, nothing else: prefill TP 1 ->
decode TP 2 or 3, prefill TP 2 -> decode TP 4), :class:`SliceStager` gathers, for a chunk
of slots, every layer's key and value piece into a contiguous buffer registered with the
sender's transport, and writes from it one span per layer, buffer and run of consecutive
destination slots, as :func:`copy_spans` does for whole rows.

The other way round (the destination row holds more heads than the piece, e.g. prefill
TP 2 -> decode TP 1) keeps per-slot spans: a one-sided write cannot scatter on the
receiver.
"""

from __future__ import annotations

import threading
import time

import torch

from radixray.engine.disaggregation.layout import HeadPiece, slot_runs
from radixray.engine.disaggregation.messages import KVLayout

STAGING_BYTES = 16 << 20  # the staging buffer: bounds a chunk, whatever the prompt's length
# ATen's at::internal::GRAIN_SIZE: on the CPU, index_select runs serially when it copies at
# most this many elements. The gather is cut into such pieces: with its OpenMP threads
# each gather waits at a barrier for a thread the kernel descheduled. Measured on 2 shared
# vCPUs: 120 gathers of 280 KB (one decode rank's share of 2048 SmolLM2 tokens) took a
# median of 9-175 ms over 9 runs, single runs up to 1 s; cut, 10 ms whatever the load.
SERIAL_ELEMENTS = 32768


def stageable(src: KVLayout, dst: KVLayout, piece: HeadPiece) -> bool:
    """Whether ``piece`` of each ``src`` row is the whole ``dst`` row, and only part of the
    ``src`` row (a whole row on both sides is already one span per run of slots)."""
    return piece.dst_head == 0 and piece.count == len(dst.heads) < len(src.heads)


class SliceStager:
    """Stages pieces of the rows of one rank's pool (per layer ``k_buffers`` and
    ``v_buffers``, ``[slots, kv_heads, head_dim]``, contiguous) for whole-row writes
    through ``transport`` (``register``, ``unregister``, ``write``).

    The staging buffer (on the pool's device, ``max_bytes``, or one slot's pieces over all
    layers where that is more) is allocated and registered on first use, and reused: each chunk's
    write is synchronous, so the buffer is free again when it returns. ``chunk_slots``
    caps the slots per chunk below what ``max_bytes`` allows (tests). Thread-safe: one
    staged write at a time (the sender thread and a handshake probe may both write).
    :meth:`close` unregisters and frees the buffer; a closed stager refuses to write.
    """

    def __init__(self, transport, k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor],
                 max_bytes: int = STAGING_BYTES, chunk_slots: int | None = None):
        if len(k_buffers) != len(v_buffers) or not k_buffers:
            raise ValueError(f"{len(k_buffers)} key buffers for {len(v_buffers)} value buffers")
        self.transport = transport
        self.buffers = list(k_buffers) + list(v_buffers)  # keys then values, as KVLayout's
        self.max_bytes, self.chunk_slots = max_bytes, chunk_slots
        self.spans = 0  # spans written, all writes together
        self.stage_seconds = 0.0  # spent gathering pieces into the buffer
        self._stage: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def write(self, session: str, src: KVLayout, src_slots: torch.Tensor, dst: KVLayout,
              dst_slots: torch.Tensor, piece: HeadPiece) -> int:
        """Write ``piece`` of the rows of ``src_slots`` (this pool, laid out as ``src``)
        into the whole rows of ``dst_slots`` of ``dst`` at peer ``session``, every layer's
        key and value; returns the bytes. ValueError when the piece is not
        :func:`stageable` or ``src`` is not this stager's pool; the transport's error when
        a write fails (earlier chunks may have landed)."""
        if not stageable(src, dst, piece):
            raise ValueError(f"{piece} of a {len(src.heads)}-head row is not a whole "
                             f"{len(dst.heads)}-head row")
        self._check_pool(src)
        src_slots, dst_slots = src_slots.to(torch.int64), dst_slots.to(torch.int64)
        if src_slots.numel() != dst_slots.numel():
            raise ValueError(f"{src_slots.numel()} source slots for {dst_slots.numel()} "
                             f"destination slots")
        head_bytes = src.head_bytes
        piece_bytes = piece.count * head_bytes  # one slot's piece: a destination row
        per_slot = len(self.buffers) * piece_bytes
        chunk = max(1, self.max_bytes // per_slot)
        if self.chunk_slots is not None:
            chunk = min(chunk, self.chunk_slots)
        dst_base = torch.tensor(dst.k_addrs + dst.v_addrs, dtype=torch.int64)
        # byte views: one gather for any dtype; the piece is heads [src_head, +count) of a row
        pieces = [b.view(torch.uint8).narrow(1, piece.src_head, piece.count)
                  for b in self.buffers]
        written = 0
        with self._lock:
            stage = self._ensure(chunk * per_slot)
            per_op = max(1, SERIAL_ELEMENTS // piece_bytes) if stage.device.type == "cpu" \
                else chunk
            for at in range(0, src_slots.numel(), chunk):
                s, d = src_slots[at:at + chunk], dst_slots[at:at + chunk]
                n = s.numel()
                t0 = time.perf_counter()
                index = s.to(stage.device)
                for b, view in enumerate(pieces):  # buffer b's rows: stage[b * n * piece_bytes:]
                    out = stage[b * n * piece_bytes:(b + 1) * n * piece_bytes].view(
                        n, piece.count, head_bytes)
                    for i in range(0, n, per_op):
                        torch.index_select(view, 0, index[i:i + per_op], out=out[i:i + per_op])
                if stage.device.type == "cuda":  # the transport reads it once copied
                    torch.cuda.current_stream(stage.device).synchronize()
                self.stage_seconds += time.perf_counter() - t0
                # staged rows are consecutive: runs break where destination slots do
                s0, d0, runs = slot_runs(torch.arange(n), d)
                src_base = stage.data_ptr() + torch.arange(len(pieces), dtype=torch.int64) \
                    * (n * piece_bytes)
                src_addrs = (src_base[:, None] + s0[None, :] * piece_bytes).flatten()
                dst_addrs = (dst_base[:, None] + d0[None, :] * dst.slot_bytes).flatten()
                lengths = (runs * piece_bytes).repeat(len(pieces))
                self.transport.write(session, src_addrs.tolist(), dst_addrs.tolist(),
                                     lengths.tolist())
                self.spans += lengths.numel()
                written += n * per_slot
        return written

    def _check_pool(self, src: KVLayout) -> None:
        addrs = tuple(b.data_ptr() for b in self.buffers)
        row = self.buffers[0][0]
        if addrs != src.k_addrs + src.v_addrs or row.numel() * row.element_size() \
                != src.slot_bytes:
            raise ValueError("the stager's pool is not the writing rank's pool")

    def _ensure(self, nbytes: int) -> torch.Tensor:
        """The staging buffer, at least ``nbytes`` and ``max_bytes`` (caller holds the
        lock)."""
        if self._closed:
            raise RuntimeError("the KV staging buffer is closed")
        if self._stage is not None and self._stage.numel() >= nbytes:
            return self._stage
        self._release()
        nbytes = max(nbytes, self.max_bytes)
        stage = torch.empty(nbytes, dtype=torch.uint8, device=self.buffers[0].device)
        self.transport.register(stage.data_ptr(), nbytes)
        self._stage = stage
        return stage

    def _release(self) -> None:
        if self._stage is not None:
            stage, self._stage = self._stage, None
            try:
                self.transport.unregister(stage.data_ptr())
            except Exception:  # noqa: BLE001 - the transport may be closed already
                pass

    def close(self) -> None:
        """Unregister and free the staging buffer (idempotent); waits for a staged write
        in progress."""
        with self._lock:
            self._closed = True
            self._release()
