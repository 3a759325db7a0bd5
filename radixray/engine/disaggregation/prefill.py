"""The prefill half of a disaggregated pair, run by the prefill engine's scheduler thread.

A request arrives with a bootstrap room and waits (Bootstrapping) until its decode
worker's :class:`KVDestination` is here; destinations may also arrive first and wait for
their request. It is then prefilled like any other (chunked, radix hits included;
WaitingForInput until its first chunk runs). After each chunk the KV of the positions the
decode side lacks is queued on the sender (Transferring); the last chunk's job carries
the first token. The request holds its KV until the sender reports the room's final
outcome, so no slot it reads is freed or reused meanwhile; only then does it finish
(Success, or Failed with status 503 so the ingress retries the pair).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from radixray.engine.disaggregation.messages import (
    PD_FAILED_STATUS,
    TIMEOUT_SCAN_S,
    CancelRoom,
    KVArrival,
    KVDestination,
    PDState,
    TransferOutcome,
)
from radixray.engine.disaggregation.sender import Fence, KVSender, WriteJob
from radixray.engine.request import FinishReason, Req

logger = logging.getLogger("radixray.pd")

CANCELLED_MEMORY_S = 600.0  # how long a cancelled room is remembered (a late request fails)


@dataclass
class _Room:
    req: Req | None = None
    dest: KVDestination | None = None
    state: PDState = PDState.BOOTSTRAPPING
    since: float = field(default_factory=time.monotonic)
    sent: int = 0  # prompt positions whose KV is queued on the sender
    closing: bool = False  # a fence or the final job is queued: the outcome ends it


class PrefillSide:
    """Rooms of one prefill engine. ``scheduler`` is the owning Scheduler (its lists, its
    KV manager, ``finish`` and ``on_output``); ``sender`` the KV sender; ``notify(worker,
    message)`` sends to a decode worker."""

    def __init__(self, scheduler, sender: KVSender, notify, worker_id: str,
                 bootstrap_timeout_s: float):
        self.s, self.sender, self.notify, self.worker_id = scheduler, sender, notify, worker_id
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.rooms: dict[int, _Room] = {}
        self._cancelled: dict[int, float] = {}  # room -> when (monotonic)
        self.inflight: list[Req] = []  # prefilled, holding KV until the final outcome
        self.bootstrap_failed = 0
        self.transfer_failed = 0
        self.transfers: list[tuple[int, float]] = []  # (bytes, seconds) since last taken
        # the scheduler hands each message of these types to its handler
        self.handlers = {KVDestination: self.on_destination, CancelRoom: self.on_cancel,
                         TransferOutcome: self.on_outcome}
        self._next_scan = 0.0

    # ---- arrivals -------------------------------------------------------------------
    def add(self, req: Req) -> None:
        if req.sampling.max_new_tokens == 0:  # the first token is sampled here regardless;
            req.sampling = dataclasses.replace(req.sampling, max_new_tokens=1)  # decode drops it
        room_id = req.pd.room
        if room_id in self._cancelled:
            self._refuse(req, f"bootstrap room {room_id} was cancelled by its decode worker")
            return
        room = self.rooms.get(room_id)
        if room is not None and room.req is not None:
            self._refuse(req, f"bootstrap room {room_id} is already in use by request "
                              f"{room.req.rid}; rooms must be unique")
            return
        if room is None:
            room = self.rooms[room_id] = _Room()
        room.req = req
        if room.dest is not None:
            self._ready(room)

    def _refuse(self, req: Req, message: str) -> None:
        self.bootstrap_failed += 1
        self.s.end_request(req, FinishReason("error", message=message, status=PD_FAILED_STATUS))

    def on_destination(self, dest: KVDestination) -> None:
        room = self.rooms.get(dest.room)
        if room is not None and room.dest is not None:
            self.notify(dest.decode_worker, CancelRoom(
                dest.room, self.worker_id, f"bootstrap room {dest.room} already has a "
                f"destination (from {room.dest.decode_worker}); rooms must be unique"))
            return
        if dest.room in self._cancelled:
            self.notify(dest.decode_worker, KVArrival(dest.room, self.worker_id, False,
                                                      "the prefill request was cancelled"))
            return
        error = self.sender.endpoint.mismatch(dest.endpoint)
        if error is not None:
            self.notify(dest.decode_worker, KVArrival(dest.room, self.worker_id, False, error))
            if room is not None and room.req is not None:
                self._fail_unstarted(room, error)
            return
        if room is None:
            room = self.rooms[dest.room] = _Room()
        room.dest = dest
        if room.req is not None:
            self._ready(room)

    def _ready(self, room: _Room) -> None:
        """Request and destination both here: check they agree, then queue the prefill."""
        req, dest = room.req, room.dest
        n = len(req.prompt_ids)
        if not 0 <= dest.start < n or len(dest.slots) != n - dest.start \
                or req.pd.peer != dest.decode_worker:
            error = (f"destination of room {dest.room} does not fit its request: decode worker "
                     f"{dest.decode_worker} (expected {req.pd.peer}), start {dest.start}, "
                     f"{len(dest.slots)} slots for a {n}-token prompt")
            self.notify(dest.decode_worker, KVArrival(dest.room, self.worker_id, False, error))
            self._fail_unstarted(room, error)
            return
        room.state = PDState.WAITING_FOR_INPUT
        room.sent = dest.start
        self.s.enqueue(req)

    def _fail_unstarted(self, room: _Room, message: str) -> None:
        self.rooms.pop(room.req.pd.room, None)
        self._refuse(room.req, message)

    # ---- the prefill's progress ------------------------------------------------------
    def after_chunk(self, req: Req, arrival: KVArrival | None = None) -> None:
        """KV of ``req`` now covers ``req.kv_len`` positions: queue what the decode side
        lacks; with ``arrival`` (the prompt is done) that job is the room's last."""
        room = self.rooms[req.pd.room]
        dest = room.dest
        end = min(req.kv_len, len(req.prompt_ids))
        if room.sent < end or arrival is not None:
            src = self.s.kv.table[req.req_row, room.sent:end].clone()
            dst = torch.tensor(dest.slots[room.sent - dest.start:end - dest.start],
                               dtype=torch.int64)
            room.state = PDState.TRANSFERRING
            self.sender.put(WriteJob(dest, src, dst, arrival))
            room.sent = end
        if arrival is not None:
            room.closing = True

    def prefilled(self, req: Req) -> None:
        """The prompt is prefilled and its first token sampled: queue the last write, which
        hands the token to the decode worker; the request waits for the outcome."""
        arrival = KVArrival(req.pd.room, self.worker_id, True, None, list(req.output_ids),
                            list(req.output_logprobs) if req.output_logprobs else None,
                            list(req.output_top_logprobs) if req.output_top_logprobs else None,
                            req.cached_tokens,
                            req.generator.get_state() if req.generator is not None else None)
        self.after_chunk(req, arrival)
        self.inflight.append(req)

    def on_outcome(self, out: TransferOutcome) -> None:
        room = self.rooms.get(out.room)
        if room is None or room.req is None:
            return
        req = room.req
        if not out.final:  # a write failed mid-prefill: stop prefilling, close the room
            self._close(room, out.error)
            return
        self.rooms.pop(out.room, None)
        if req in self.inflight:
            self.inflight.remove(req)
        if out.ok:
            room.state = PDState.SUCCESS
            self.transfers.append((out.bytes, out.seconds))
            if not req.finished:
                self.s.end_request(req, FinishReason("length", length=len(req.output_ids)))
            return
        room.state = PDState.FAILED
        self.transfer_failed += out.write_failed
        if not req.finished:
            self.s.end_request(req, FinishReason("error", message=out.error, status=PD_FAILED_STATUS))
        else:  # its output went out already (aborted): only its KV was held
            self.s.kv.release(req)

    def _close(self, room: _Room, reason: str, tell_client: FinishReason | None = None) -> None:
        """Stop scheduling the room's request and queue the fence whose outcome frees its KV;
        ``tell_client``: end the request for its caller now (abort)."""
        req = room.req
        if room.closing:
            if tell_client is not None and not req.finished:
                self._end_for_client(req, tell_client)
            return
        room.closing = True
        self.s.unschedule(req)
        if req not in self.inflight:
            self.inflight.append(req)
        if tell_client is not None:
            self._end_for_client(req, tell_client)
        self.sender.put(Fence(req.pd.room, reason, room.dest.decode_worker))

    def _end_for_client(self, req: Req, reason: FinishReason) -> None:
        self.s.end_request(req, reason, release=False)

    # ---- giving up -------------------------------------------------------------------
    def abort(self, rid: str, message: str) -> bool:
        """Abort a request of a room; False if ``rid`` is not one this side holds back."""
        for room_id, room in list(self.rooms.items()):
            req = room.req
            if req is None or req.rid != rid or req.finished:
                continue
            if room.dest is None or (req.req_row is None and not room.closing):
                if room.dest is not None:
                    self.notify(room.dest.decode_worker, KVArrival(
                        room_id, self.worker_id, False, message))
                self.rooms.pop(room_id, None)
                self.s.end_request(req, FinishReason("abort", message=message))
            else:
                self._close(room, message, FinishReason("abort", message=message))
            return True
        return False

    def on_cancel(self, msg: CancelRoom) -> None:
        """The decode side gave up on a room: abort its request (the fence tells the decode
        side when nothing more will be written)."""
        self._cancelled[msg.room] = time.monotonic()
        room = self.rooms.get(msg.room)
        if room is None:
            return
        if room.req is None:
            self.rooms.pop(msg.room, None)
            return
        self.abort(room.req.rid, f"cancelled by decode worker {msg.sender}: {msg.reason}")

    def poll(self, now: float) -> None:
        """Fail requests and drop destinations that waited past the bootstrap timeout."""
        if now < self._next_scan:
            return
        self._next_scan = now + TIMEOUT_SCAN_S
        limit = self.bootstrap_timeout_s
        for room_id, room in list(self.rooms.items()):
            if room.state is not PDState.BOOTSTRAPPING or now - room.since < limit:
                continue
            self.rooms.pop(room_id, None)
            if room.req is not None:
                self.bootstrap_failed += 1
                self.notify(room.req.pd.peer, CancelRoom(
                    room_id, self.worker_id, f"no KV destination within {limit:.0f} s"))
                self.s.finish(room.req, FinishReason(
                    "error", status=PD_FAILED_STATUS, message=(
                        f"prefill bootstrap timed out: decode worker {room.req.pd.peer} sent no "
                        f"KV destination for room {room_id} within {limit:.0f} s "
                        f"(disaggregation_bootstrap_timeout_s)")))
                self.s.on_output([room.req])
            else:
                self.notify(room.dest.decode_worker, KVArrival(
                    room_id, self.worker_id, False,
                    f"no prefill request for room {room_id} arrived within {limit:.0f} s"))
        for room_id, when in list(self._cancelled.items()):
            if now - when > CANCELLED_MEMORY_S:
                del self._cancelled[room_id]

    # ---- accounting ------------------------------------------------------------------
    def holders(self) -> list[Req]:
        """Requests holding KV outside the scheduler's running list."""
        return [r for r in self.inflight if r.req_row is not None]

    def unfinished(self) -> list[Req]:
        return [r.req for r in self.rooms.values() if r.req is not None and not r.req.finished]

    def counts(self) -> dict[str, int]:
        boot = sum(1 for r in self.rooms.values() if r.state is PDState.BOOTSTRAPPING and r.req)
        return {"bootstrap": boot, "transfer": len(self.inflight), "sender": self.sender.pending()}
