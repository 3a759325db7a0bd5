"""The prefill engine's KV sender: a thread that performs the queued writes in order.

The scheduler queues one :class:`WriteJob` per finished prefill chunk (and the last one
carries the room's :class:`KVArrival`), then a :class:`Fence` when it gives up on a room.
Jobs run first in, first out, so when the sender reports a room's
:class:`TransferOutcome` no write of that room is pending and its KV slots may be freed.
The scheduler never waits for the network.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixray.engine.disaggregation.layout import copy_spans, head_plan
from radixray.engine.disaggregation.messages import (
    KVArrival,
    KVDestination,
    KVEndpoint,
    TransferOutcome,
)
from radixray.engine.disaggregation.staging import SliceStager, stageable
from radixray.engine.faults import FaultInjector

logger = logging.getLogger("radixray.pd")


def write_share(transport, src: KVEndpoint, rank: int, src_slots: torch.Tensor,
                dst: KVEndpoint, dst_slots: torch.Tensor, stager: SliceStager | None = None
                ) -> int:
    """Rank ``rank`` of worker ``src`` writes its share of ``src_slots`` into ``dst_slots``
    of worker ``dst`` (every destination rank it owes heads to); returns the bytes.

    Each piece goes as the spans :func:`copy_spans` plans, except, given ``stager`` (over
    this rank's pool, on ``transport``), a piece that is a destination's whole row but
    only part of ours: staged, then written in whole rows (see staging.py)."""
    mine = src.layouts[rank]
    written = 0
    for d, pieces in head_plan(src, rank, dst).items():
        session, theirs = dst.sessions[d], dst.layouts[d]
        for piece in pieces:
            if stager is not None and stageable(mine, theirs, piece):
                written += stager.write(session, mine, src_slots, theirs, dst_slots, piece)
                continue
            src_addrs, dst_addrs, lengths = copy_spans(mine, src_slots, theirs, dst_slots,
                                                       piece)
            transport.write(session, src_addrs, dst_addrs, lengths)
            written += sum(lengths)
    return written


@dataclass(slots=True)
class WriteJob:
    """Write the KV of ``src_slots`` (this pool) into ``dst_slots`` of ``dest``; ``arrival``
    (the last job of a room) goes to the decode worker once everything landed."""

    dest: KVDestination
    src_slots: torch.Tensor
    dst_slots: torch.Tensor
    arrival: KVArrival | None = None


@dataclass(slots=True)
class Fence:
    """The scheduler gave up on ``room``: report its outcome (failed, ``reason``) once every
    earlier job ran, skipping the room's writes still queued."""

    room: int
    reason: str
    decode_worker: str | None = None  # told of the failure unless a write failure already did


@dataclass
class _RoomProgress:
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


class KVSender:
    """``transport.write(session, src, dst, lengths)`` in a thread; ``report(outcome)``
    hands outcomes to the scheduler; ``notify(worker, message)`` sends to the decode side.
    ``endpoint``: this worker's ranks; with tensor parallelism ``group`` (a
    :class:`~radixray.engine.disaggregation.tp_group.GroupWrites`) has the followers write
    their shares of each job, and a job ends when every rank's share landed.

    Per room: the decode worker gets exactly one :class:`KVArrival` (success with the
    first token, or the failure); the scheduler gets one final :class:`TransferOutcome`
    at the room's last job or fence, and before it one early, non-final failure when a
    write fails mid-prefill (so it stops prefilling and queues the fence).
    ``faults`` (a :class:`~radixray.engine.faults.FaultInjector`, tests only) is asked
    before each write. ``stager`` (a :class:`SliceStager` over this rank's pool) re-slices
    rows for a decode worker of more ranks; the sender owns it and closes it when its
    thread ends.
    """

    def __init__(self, transport, endpoint: KVEndpoint, worker_id: str,
                 report: Callable[[TransferOutcome], None],
                 notify: Callable[[str, object], None], group=None,
                 stager: SliceStager | None = None):
        self.transport, self.endpoint, self.worker_id = transport, endpoint, worker_id
        self.group, self.stager = group, stager
        self.report, self.notify = report, notify
        self.faults: FaultInjector | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._rooms: dict[int, _RoomProgress] = {}
        self._thread = threading.Thread(target=self._run, name="radixray-kv-sender", daemon=True)
        self._thread.start()

    def put(self, job: WriteJob | Fence) -> None:
        self._queue.put(job)

    def pending(self) -> int:
        """Jobs waiting for the sender (approximate: a gauge)."""
        return self._queue.qsize()

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                if self.stager is not None:  # no write of this thread is in flight now
                    self.stager.close()
                return
            try:
                if isinstance(job, Fence):
                    self._end(job.room, None, job.reason, job.decode_worker)
                else:
                    self._write(job)
            except Exception:  # noqa: BLE001 - the thread must outlive any one job
                logger.exception("KV sender job failed unexpectedly")

    def _write(self, job: WriteJob) -> None:
        room = job.dest.room
        progress = self._rooms.setdefault(room, _RoomProgress())
        if progress.error is None:
            t0 = time.perf_counter()
            try:
                if self.faults is not None:
                    self.faults.before_kv_write(final=job.arrival is not None)
                progress.bytes += self.write(job.dest.endpoint, job.src_slots, job.dst_slots)
            except Exception as exc:  # noqa: BLE001 - a failure fails the room, not the thread
                progress.error = f"KV transfer to {job.dest.decode_worker} failed: {exc}"
                logger.warning("room %d: %s", room, progress.error)
                self.notify(job.dest.decode_worker,
                            KVArrival(room, self.worker_id, False, progress.error))
                if job.arrival is None:
                    self.report(TransferOutcome(room, False, progress.error, progress.bytes,
                                                progress.seconds, final=False))
            progress.seconds += time.perf_counter() - t0
        if job.arrival is not None:
            self._end(room, job.arrival, None, job.dest.decode_worker)

    def write(self, dest: KVEndpoint, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> int:
        """Every rank's share of one job (the followers' through ``group``); returns the
        bytes; raises when any share failed, once every rank is done with the job."""
        ticket = None if self.group is None else self.group.dispatch(dest, src_slots, dst_slots)
        try:
            written = write_share(self.transport, self.endpoint, 0, src_slots, dest, dst_slots,
                                  self.stager)
        finally:  # the followers' writes end before this job does, whatever happened here
            error, theirs = (None, 0) if ticket is None else self.group.wait(ticket)
        if error is not None:
            raise RuntimeError(error)
        return written + theirs

    def _end(self, room: int, arrival: KVArrival | None, reason: str | None,
             decode_worker: str | None) -> None:
        """The room's last job (``arrival``) or fence (``reason``) ran: tell the decode
        worker (unless a failure already did) and the scheduler."""
        progress = self._rooms.pop(room, _RoomProgress())
        error = progress.error or reason
        if progress.error is None and decode_worker is not None:
            if arrival is not None and error is None:
                arrival.bytes, arrival.seconds = progress.bytes, progress.seconds
                self.notify(decode_worker, arrival)
            else:
                self.notify(decode_worker, KVArrival(room, self.worker_id, False, error))
        self.report(TransferOutcome(room, error is None, error, progress.bytes,
                                    progress.seconds, final=True,
                                    write_failed=progress.error is not None))
