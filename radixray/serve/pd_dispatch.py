"""Route requests to prefill-decode pairs, with one retry on other workers.

For each group of requests submitted together (``n`` choices, a batch) the router picks
one pair; each request gets its own random 63-bit bootstrap room and goes to both
workers at once: the decode worker reserves KV slots for it and streams its output, the
prefill worker computes its prompt's KV, writes it into those slots and finishes. The
caller reads the decode worker's stream; the prefill worker's stream is watched only for
failure.

A request whose pair fails before its first token (either worker's channel dies, or the
handshake, a transfer or a timeout fails: status 503) is aborted on both workers and
placed once more on a pair of workers it has not tried (the failed side is excluded;
both sides when the failure is the pair's protocol). Without such a pair, or after the
retry, its stream ends with a 503 error naming each attempt's cause. Tokens already
streamed are never retried. Every pick is released once per worker with its outcome.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from radixray.cluster.errors import WorkerDraining, WorkerUnavailable
from radixray.cluster.messages import SubmitRequest
from radixray.cluster.routing import NoWorkerAvailable
from radixray.engine.disaggregation.messages import MAX_ROOM, PDBootstrap
from radixray.engine.messages import RequestUpdate
from radixray.serve.closing_stream import ClosingStream, discard_all
from radixray.serve.dispatch import (
    Dispatcher,
    Lease,
    close_all,
    fails_before_first_token,
    outcome_of,
)
from radixray.serve.worker_client import refuse_rids_in_flight

logger = logging.getLogger("radixray.ingress")

PD_ATTEMPTS = 2  # the first pair and one retry on other workers
PREFILL_END_WAIT_S = 10.0  # after the decode side finished, for the prefill side's last update


@dataclass
class _Placed:
    prefill: str
    decode: str
    p_streams: list
    d_streams: list
    p_lease: Lease
    d_lease: Lease


class PDDispatcher(Dispatcher):
    """:class:`Dispatcher` for a disaggregated fleet (same ``run`` contract)."""

    async def run(self, requests: list[SubmitRequest], route_text: str,
                  session_id: str | None = None) -> list[AsyncIterator[RequestUpdate]]:
        refuse_rids_in_flight(requests, self.clients.values())
        tried: set[str] = set()
        placed, errors = await self._place_pair(requests, route_text, session_id, tried, [])
        return [ClosingStream(self._follow_pair(r, placed, i, route_text, session_id, tried,
                                                errors), functools.partial(_give_back, placed, i))
                for i, r in enumerate(requests)]

    async def _place_pair(self, requests, route_text, session_id, tried: set[str],
                          errors: list[str]) -> tuple[_Placed, list[str]]:
        """Pick a pair, submit to both; raises after PD_ATTEMPTS (WorkerUnavailable)."""
        while len(errors) < PD_ATTEMPTS:
            try:
                p, d, _ = await self.router.pick_pair(route_text, session_id, sorted(tried),
                                                      bool(errors))
            except NoWorkerAvailable as err:
                if not errors and await self._fleet_draining():
                    raise WorkerDraining("the fleet is draining and takes no new requests") \
                        from None
                raise WorkerUnavailable(self._summary(errors + [f"no pair left: {err}"])) \
                    from None
            rooms = [secrets.randbelow(MAX_ROOM) for _ in requests]
            to_p = [replace(r, bootstrap=PDBootstrap(room, d)) for r, room in zip(requests, rooms)]
            to_d = [replace(r, bootstrap=PDBootstrap(room, p)) for r, room in zip(requests, rooms)]
            p_out, d_out = await asyncio.gather(self._submit(p, to_p), self._submit(d, to_d),
                                                return_exceptions=True)
            failed = [(w, x) for w, x in ((p, p_out), (d, d_out)) if isinstance(x, BaseException)]
            if not failed:
                n = len(requests)
                return _Placed(p, d, p_out, d_out, Lease(self.router, p, n),
                               Lease(self.router, d, n)), errors
            for w, x in ((p, p_out), (d, d_out)):
                if isinstance(x, BaseException):
                    bad = isinstance(x, WorkerUnavailable)
                    self.router.release(w, False if bad else None)
                else:  # accepted: closing its unread streams aborts them (the room too)
                    await close_all(x)
                    self.router.release(w, None)
            worker, exc = failed[0]
            if isinstance(exc, ValueError) or not isinstance(exc, (WorkerDraining,
                                                                   WorkerUnavailable)):
                raise exc  # bad input, or a bug: not the pair's fault
            tried.update(w for w, _ in failed)
            errors.append(f"{worker}: {exc}")
            logger.warning("request not placed on pair %s/%s: %s", p, d, exc)
        raise WorkerUnavailable(self._summary(errors))

    async def _submit(self, worker: str, requests: list[SubmitRequest]):
        client = await self.client(worker)
        return await client.run(requests)

    @staticmethod
    def _summary(errors: list[str]) -> str:
        return "prefill-decode pair failed: " + "; ".join(errors)

    async def _follow_pair(self, request: SubmitRequest, placed: _Placed, i: int, route_text,
                           session_id, tried: set[str], errors: list[str]
                           ) -> AsyncIterator[RequestUpdate]:
        started, outcome = False, None
        while True:
            queue: asyncio.Queue = asyncio.Queue()
            pumps = [asyncio.create_task(_pump(side, s[i], queue)) for side, s in
                     (("p", placed.p_streams), ("d", placed.d_streams))]
            failed, p_ok, d_done = None, None, False
            try:
                while not d_done:
                    side, update = await queue.get()
                    if update is None:  # that side's stream ended without a last update
                        if side == "d":
                            d_done = True
                        continue
                    if side == "p":
                        if update.finished:
                            p_ok = update.error is None
                            if not p_ok and not started:
                                failed = ("p", update)
                                break
                        continue
                    if fails_before_first_token(update, started):
                        failed = ("d", update)
                        break
                    outcome = outcome_of(update, placed.decode, outcome)
                    started = True
                    d_done = update.finished
                    yield update
                if failed is None:
                    if p_ok is None:  # let the prefill side end on its own (no abort)
                        p_ok = await _prefill_end(queue, PREFILL_END_WAIT_S)
                    return
            finally:
                for t in pumps:
                    t.cancel()
                await close_all([placed.p_streams[i], placed.d_streams[i]])
                if failed is None:
                    placed.p_lease.done(p_ok if p_ok is not None else outcome)
                    placed.d_lease.done(outcome)
            side, update = failed
            worker = placed.prefill if side == "p" else placed.decode
            channel_died = update.status is None
            placed.p_lease.done(False if side == "p" or not channel_died else None)
            placed.d_lease.done(False if side == "d" or not channel_died else None)
            tried.add(worker)
            if not channel_died:  # the pair's protocol failed: try other workers on both sides
                tried.update((placed.prefill, placed.decode))
            errors.append(f"{worker}: {update.error}")
            logger.warning("request %s failed on pair %s/%s before its first token: %s",
                           request.rid, placed.prefill, placed.decode, update.error)
            try:
                placed, errors = await self._place_pair([request], route_text, session_id,
                                                        tried, errors)
                i = 0
            except Exception as exc:  # noqa: BLE001 - out of pairs: a clean error
                yield RequestUpdate.failure(request.rid, str(exc) if isinstance(
                    exc, WorkerUnavailable) else self._summary(errors + [str(exc)]), 503)
                return


def _give_back(placed: _Placed, i: int) -> None:
    """Request ``i`` of a pair given up unread: both leases' shares back, both sides'
    streams given up (which aborts it on each worker)."""
    placed.p_lease.done(None)
    placed.d_lease.done(None)
    discard_all([placed.p_streams[i], placed.d_streams[i]])


async def _prefill_end(queue: asyncio.Queue, timeout: float) -> bool | None:
    """Read the queue until the prefill side's last update; its outcome (None: timed out)."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                side, update = await queue.get()
                if side == "p" and (update is None or update.finished):
                    return update is not None and update.error is None
    except TimeoutError:
        return None


async def _pump(side: str, stream, queue: asyncio.Queue) -> None:
    async for update in stream:
        await queue.put((side, update))
    await queue.put((side, None))
