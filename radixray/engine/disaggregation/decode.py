"""The decode half of a disaggregated pair, run by the decode engine's scheduler thread.

A request arrives with a bootstrap room and its prefill worker's id and waits in the
prealloc queue (Bootstrapping) until the pool can hold its prompt and the forecast of
its output, as admission would reserve it; a prefix of the prompt already in this
engine's radix cache is reused, and only the rest is reserved. Then its
:class:`KVDestination` goes to the prefill worker (WaitingForInput). The prefill
worker's :class:`KVArrival` says the KV is in the slots and brings the first token: the
request joins the running batch without any prefill here (Success). A failed arrival,
or none within the waiting timeout, fails the request with status 503 (Failed).

Slots written by a peer are freed only when the peer can no longer write them: an
aborted or timed-out request's slots stay reserved (counted as request-held) until the
prefill side's arrival for the room (which ends every room it received a destination
for) or, if the prefill worker is gone, the waiting timeout.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from radixray.engine.disaggregation.messages import (
    PD_FAILED_STATUS,
    TIMEOUT_SCAN_S,
    CancelRoom,
    KVArrival,
    KVDestination,
    KVEndpoint,
    PDState,
    PeerGone,
)
from radixray.engine.request import FinishReason, Req
from radixray.engine.sched.admission import CLIP_MAX_NEW_TOKENS

logger = logging.getLogger("radixray.pd")



@dataclass
class _Room:
    req: Req
    state: PDState = PDState.BOOTSTRAPPING
    since: float = field(default_factory=time.monotonic)
    start: int = 0  # prompt positions below this were cached here
    quarantined: bool = False  # ended for its caller; slots wait for the prefill side


class DecodeSide:
    """Rooms of one decode engine; ``send(worker, message)`` reaches a prefill worker."""

    def __init__(self, scheduler, endpoint: KVEndpoint, send, worker_id: str,
                 waiting_timeout_s: float):
        self.s, self.endpoint, self.send = scheduler, endpoint, send
        self.worker_id, self.waiting_timeout_s = worker_id, waiting_timeout_s
        self.rooms: dict[int, _Room] = {}
        self.prealloc: list[Req] = []
        self.transfer_failed = 0
        self.bootstrap_failed = 0
        # the scheduler hands each message of these types to its handler
        self.handlers = {KVArrival: self.on_arrival, CancelRoom: self.on_cancel,
                         PeerGone: lambda m: self.on_peer_gone(m.room, m.error)}
        self._next_scan = 0.0

    def add(self, req: Req) -> None:
        if req.pd.room in self.rooms:
            self.bootstrap_failed += 1
            self.s.finish(req, FinishReason("error", status=PD_FAILED_STATUS, message=(
                f"bootstrap room {req.pd.room} is already in use on this decode worker; "
                "rooms must be unique")))
            self.s.on_output([req])
            return
        self.rooms[req.pd.room] = _Room(req)
        self.prealloc.append(req)

    # ---- reserving slots -------------------------------------------------------------
    def waiting_reqs(self) -> list[Req]:
        """Requests with reserved slots whose KV has not arrived."""
        return [r.req for r in self.rooms.values()
                if r.state is PDState.WAITING_FOR_INPUT and not r.quarantined]

    def try_prealloc(self) -> None:
        """Reserve slots for queued requests, first come first served, while they fit."""
        kv = self.s.kv
        while self.prealloc:
            req = self.prealloc[0]
            waiting = self.waiting_reqs()
            if not self.s.has_decode_row(len(waiting)):
                return
            match = kv.match(req)
            extend = len(req.prompt_ids) - len(match.slots)
            need = extend + min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS)
            room_left = kv.available_tokens() - kv.lock_cost(match) - self.s.reserved_tokens(
                waiting)
            alone = not self.s.num_running and not waiting and extend < kv.available_tokens()
            if need > room_left and not alone:
                return
            if not kv.admit(req, match):
                return
            slots = kv.extend(req, extend)
            if slots is None:
                kv.release(req)
                return
            self.prealloc.pop(0)
            req.admit_time = time.perf_counter()
            room = self.rooms[req.pd.room]
            room.state, room.since, room.start = PDState.WAITING_FOR_INPUT, time.monotonic(), \
                req.kv_len
            self.send(req.pd.peer, KVDestination(req.pd.room, self.worker_id, self.endpoint,
                                                 slots.tolist(), req.kv_len))

    # ---- the prefill side's answers --------------------------------------------------
    def on_arrival(self, msg: KVArrival) -> None:
        room = self.rooms.get(msg.room)
        if room is None:
            return  # long gone (timed out without a peer, or never here)
        req = room.req
        if room.quarantined or room.state is not PDState.WAITING_FOR_INPUT:
            if room.state is PDState.BOOTSTRAPPING and not msg.ok:  # refused before prealloc
                self._fail(room, msg.error)
            elif room.quarantined:
                self._drop(room)
            return
        if not msg.ok:
            self.transfer_failed += 1
            self._fail(room, msg.error)
            return
        del self.rooms[msg.room]
        room.state = PDState.SUCCESS
        req.commit_kv(len(req.prompt_ids) - room.start)
        self.s.kv.cache_unfinished(req)
        req.cached_tokens = msg.cached_tokens
        if req.generator is not None and msg.generator_state is not None:
            req.generator.set_state(msg.generator_state)  # as if it had sampled the first
        req.pd = None  # an ordinary running request from here on (retraction re-prefills)
        self._start_decoding(req, msg)

    def _start_decoding(self, req: Req, msg: KVArrival) -> None:
        """Add the first token(s) the prefill worker sampled, check stops as a prefill here
        would, and join the running batch (or finish)."""
        s = self.s
        for i, token in enumerate(msg.output_ids):
            if req.remaining_new_tokens == 0:
                break
            req.output_ids.append(token)
            if req.sampling.return_logprob and msg.logprobs is not None:
                req.output_logprobs.append(msg.logprobs[i])
                if msg.top_logprobs is not None:
                    req.output_top_logprobs.append(msg.top_logprobs[i])
        req.first_token_time = time.perf_counter()
        s.stats.generation_tokens += len(req.output_ids)
        reason = s.stop_checker.check(req, s.runner.context_len) if req.output_ids \
            else FinishReason("length", length=0)
        if reason is None and req.remaining_new_tokens == 0:
            reason = FinishReason("length", length=len(req.output_ids))
        if reason is not None:
            s.finish(req, reason)
        else:
            s.start_running(req)
        s.on_output([req])

    def on_cancel(self, msg: CancelRoom) -> None:
        """The prefill side gave up before writing anything (no destination reached it)."""
        self.on_peer_gone(msg.room, f"prefill worker {msg.sender} cancelled room {msg.room}: "
                                    f"{msg.reason}")

    def _fail(self, room: _Room, error: str | None) -> None:
        req = room.req
        self.rooms.pop(req.pd.room, None)
        if req in self.prealloc:
            self.prealloc.remove(req)
        room.state = PDState.FAILED
        self.s.end_request(req, FinishReason("error", status=PD_FAILED_STATUS, message=(
            f"prefill worker {req.pd.peer}: {error}")))

    def _drop(self, room: _Room) -> None:
        """A quarantined room's slots may be freed now."""
        self.rooms.pop(room.req.pd.room, None)
        self.s.kv.release(room.req)

    # ---- giving up -------------------------------------------------------------------
    def abort(self, rid: str, message: str) -> bool:
        for room in list(self.rooms.values()):
            if room.req.rid == rid and not room.quarantined:
                self._give_up(room, FinishReason("abort", message=message), message)
                return True
        return False

    def _give_up(self, room: _Room, reason: FinishReason, why: str) -> None:
        """End the request for its caller; tell the prefill side; keep reserved slots until
        it answers (or the waiting timeout passes)."""
        req = room.req
        if room.state is PDState.BOOTSTRAPPING:
            self.prealloc.remove(req)
            self.rooms.pop(req.pd.room, None)
            self.s.end_request(req, reason)
            return
        room.quarantined, room.since = True, time.monotonic()
        self.s.end_request(req, reason, release=False)
        self.send(req.pd.peer, CancelRoom(req.pd.room, self.worker_id, why))

    def on_peer_gone(self, room_id: int, error: str) -> None:
        """The room's prefill worker will write nothing (it cancelled, or a message to it
        could not be delivered: it is dead): fail the request, or free a quarantined room."""
        room = self.rooms.get(room_id)
        if room is None:
            return
        if room.quarantined:
            self._drop(room)
        else:
            self.bootstrap_failed += 1
            self._fail(room, error)

    def poll(self, now: float) -> None:
        """Reserve slots for queued requests; then (every TIMEOUT_SCAN_S) the waiting
        timeout: a request whose KV has not come fails (its slots stay reserved one more
        timeout in case the prefill worker still writes); a quarantined room past it frees
        its slots."""
        self.try_prealloc()
        if now < self._next_scan:
            return
        self._next_scan = now + TIMEOUT_SCAN_S
        limit = self.waiting_timeout_s
        for room in list(self.rooms.values()):
            if room.state is not PDState.WAITING_FOR_INPUT or now - room.since < limit:
                continue
            if room.quarantined:
                logger.warning("room %d: prefill worker %s never answered the cancel; freeing "
                               "its slots", room.req.pd.room, room.req.pd.peer)
                self._drop(room)
                continue
            self.transfer_failed += 1
            error = (f"no KV arrived from prefill worker {room.req.pd.peer} for room "
                     f"{room.req.pd.room} within {limit:.0f} s "
                     f"(disaggregation_waiting_timeout_s)")
            self._give_up(room, FinishReason("error", message=error, status=PD_FAILED_STATUS),
                          error)

    def holders(self) -> list[Req]:
        return [r.req for r in self.rooms.values() if r.req.req_row is not None]

    def unfinished(self) -> list[Req]:
        return [r.req for r in self.rooms.values() if not r.req.finished]

    def counts(self) -> dict[str, int]:
        return {"prealloc": len(self.prealloc), "transfer": len(self.waiting_reqs())}
