"""Route requests to workers, with retries, from one ingress replica.

:class:`Dispatcher` asks the router actor for a worker, opens (and reopens,
after a restart) one :class:`WorkerClient` channel per worker, and submits.
A request that fails before its first token is placed again on a worker it has
not tried, up to ``max_attempts`` attempts in all, sleeping ``backoff_s``,
doubling, between attempts:

- at submit: the worker is draining (:class:`WorkerDraining`) or gone, or its
  engine failed (:class:`WorkerUnavailable`);
- on the stream: the worker died, or its engine failed (status 503), before the
  request's first token.

A request whose batch hit a fault (status 500) is not retried: it may be the
cause, and another worker would fail the same way. Nor is one refused for its own input
once running (status 4xx: a grammar that did not compile), which is no fault of the worker.

A request that already streamed tokens is never retried: its stream ends with
an ``error`` update (an error event for SSE clients). Every pick is paired with
one ``release`` to the router when the request group ends, reporting success
or failure for the router's circuit breaker (a draining refusal or a client
that went away counts as neither).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import defaultdict
from collections.abc import AsyncIterator

from radixray.cluster.errors import WorkerDraining, WorkerUnavailable, unwrap_ray_error
from radixray.cluster.messages import SubmitRequest
from radixray.cluster.router_client import RouterClient
from radixray.cluster.routing import NoWorkerAvailable
from radixray.engine.faults import BATCH_FAULT_STATUS
from radixray.engine.messages import RequestUpdate
from radixray.serve.closing_stream import ClosingStream, discard_all
from radixray.serve.worker_client import WorkerClient, refuse_rids_in_flight

logger = logging.getLogger("radixray.ingress")

MAX_BACKOFF_S = 2.0


def ids_route_text(ids: list[int]) -> str:
    """Route text for requests given as token ids: one character per token."""
    return "".join(map(chr, ids))


def client_error(update: RequestUpdate) -> bool:
    """An error of the request's own input, found once it ran (status 4xx: a grammar that
    did not compile): never retried, and no fault of the worker."""
    return update.error is not None and update.status is not None and update.status < 500


def fails_before_first_token(update: RequestUpdate, started: bool) -> bool:
    """An error before any token, not of the request's own batch (status 500) nor of its
    input (4xx): the worker or its engine went away, so the request may be placed again."""
    return update.error is not None and not started and update.status != BATCH_FAULT_STATUS \
        and not client_error(update)


def outcome_of(update: RequestUpdate, worker: str, outcome: bool | None) -> bool | None:
    """The request's outcome for the router's circuit breaker after ``update`` (which
    gets ``worker`` in its meta when it is the last)."""
    if update.error is not None:
        return None if client_error(update) else False
    if update.meta is not None:
        update.meta.worker_id = worker
        return True
    return outcome


async def close_all(streams: list[AsyncIterator]) -> None:
    """Close update iterators; an unfinished one aborts its request on the worker, read
    from or not (serve/closing_stream.py)."""
    for s in streams:
        try:
            await s.aclose()
        except Exception:  # noqa: BLE001 - closing must not mask the original error
            pass


def _give_back(lease: Lease, stream) -> None:
    """An unread request's cleanup: its share of the router pick back, its worker stream
    given up (which aborts it there)."""
    lease.done(None)
    discard_all([stream])


class Lease:
    """One router pick shared by the requests submitted together (n choices, a batch)."""

    def __init__(self, router, worker: str, refs: int):
        self.router, self.worker, self.refs = router, worker, refs
        self.failed = self.succeeded = False

    def done(self, ok: bool | None) -> None:
        self.failed |= ok is False
        self.succeeded |= ok is True
        self.refs -= 1
        if self.refs == 0:
            outcome = False if self.failed else (True if self.succeeded else None)
            self.router.release(self.worker, outcome)


class Dispatcher:
    def __init__(self, controller, router, max_attempts: int = 3, backoff_s: float = 0.1,
                 sleep=asyncio.sleep, step_transport: str = "tcp"):
        self.controller = controller
        self.step_transport = step_transport  # server.step_transport, of every channel opened
        self.router = router if isinstance(router, RouterClient) else RouterClient(router)
        self.max_attempts, self.backoff_s, self._sleep = max_attempts, backoff_s, sleep
        self.clients: dict[str, WorkerClient] = {}
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def start(self) -> None:
        """Open channels to every live worker now (later ones open on first use)."""
        for entry in await self.controller.live_workers.remote():
            await self.client(entry.worker_id)

    async def close(self) -> None:
        for c in self.clients.values():
            await c.close()

    async def client(self, worker_id: str) -> WorkerClient:
        """An open channel to ``worker_id``; reopened when the worker was restarted."""
        c = self.clients.get(worker_id)
        if c is not None and c.alive:
            return c
        async with self._locks[worker_id]:
            c = self.clients.get(worker_id)
            if c is not None and c.alive:
                return c
            try:
                entry = await self.controller.worker.remote(worker_id)
            except Exception as exc:
                raise unwrap_ray_error(exc) from None
            if c is not None:
                await c.close()
            c = WorkerClient(entry.handle, worker_id, self.step_transport)
            await c.start()
            self.clients[worker_id] = c
            return c

    # ---- placing requests ------------------------------------------------------------
    async def run(self, requests: list[SubmitRequest], route_text: str,
                  session_id: str | None = None) -> list[AsyncIterator[RequestUpdate]]:
        """Place ``requests`` together on one worker; one update iterator per request.

        Raises ApiError 400 for an id already in flight from this replica, ValueError (bad
        input, from the worker), WorkerDraining (the whole
        fleet drains) or WorkerUnavailable (no worker took it in ``max_attempts``).
        """
        refuse_rids_in_flight(requests, self.clients.values())
        tried: set[str] = set()
        worker, streams, attempts = await self._place(requests, route_text, session_id, tried, 0)
        lease = Lease(self.router, worker, len(requests))
        return [ClosingStream(self._follow(r, s, lease, route_text, session_id, tried, attempts),
                              functools.partial(_give_back, lease, s))
                for r, s in zip(requests, streams)]

    async def _place(self, requests, route_text, session_id, tried: set[str], attempts: int):
        last: Exception | None = None
        while attempts < self.max_attempts:
            if attempts:
                await self._sleep(min(self.backoff_s * 2 ** (attempts - 1), MAX_BACKOFF_S))
            attempts += 1
            worker = await self._pick(route_text, session_id, tried, attempts > 1, last)
            tried.add(worker)
            try:
                client = await self.client(worker)
                return worker, await client.run(requests), attempts
            except WorkerDraining as exc:
                self.router.release(worker, None)
                last = exc
            except WorkerUnavailable as exc:
                self.router.release(worker, False)
                last = exc
            except BaseException:
                self.router.release(worker, None)
                raise
            logger.warning("request not placed on %s (attempt %d/%d): %s", worker, attempts,
                           self.max_attempts, last)
        raise last

    async def _pick(self, route_text, session_id, tried, retry: bool, last) -> str:
        try:
            worker, _reason = await self.router.pick(route_text, session_id, sorted(tried),
                                                     retry)
            return worker
        except NoWorkerAvailable as exc:
            err = exc
        if last is not None:
            raise last
        if await self._fleet_draining():
            raise WorkerDraining("the fleet is draining and takes no new requests")
        raise WorkerUnavailable(f"no engine worker is available: {err}")

    async def _fleet_draining(self) -> bool:
        """Whether the whole fleet drains (False when the controller cannot say: it is
        restarting, and the request gets the plain 503 of an unavailable fleet)."""
        try:
            return (await self.controller.health.remote()).draining
        except Exception:  # noqa: BLE001 - the controller restarts; workers may still serve
            return False

    async def _follow(self, request: SubmitRequest, stream, lease: Lease, route_text, session_id,
                      tried: set[str], attempts: int) -> AsyncIterator[RequestUpdate]:
        started, outcome = False, None
        try:
            while True:
                failed = None
                async for update in stream:
                    if fails_before_first_token(update, started):
                        failed = update
                        break
                    outcome = outcome_of(update, lease.worker, outcome)
                    started = True
                    yield update
                if failed is None:
                    return
                lease.done(False)
                lease, outcome = None, None
                logger.warning("request %s failed on a worker before its first token: %s",
                               request.rid, failed.error)
                try:
                    worker, streams, attempts = await self._place(
                        [request], route_text, session_id, tried, attempts)
                except Exception as exc:  # noqa: BLE001 - out of attempts: a clean error
                    yield RequestUpdate.failure(
                        request.rid, f"{failed.error}; retrying failed: {exc}", 503)
                    return
                await stream.aclose()
                lease, stream = Lease(self.router, worker, 1), streams[0]
        finally:
            if lease is not None:
                lease.done(outcome)
            await stream.aclose()  # unfinished: aborts the request on its worker
