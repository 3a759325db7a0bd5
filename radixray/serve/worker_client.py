"""The ingress side of one EngineWorker channel.

One :class:`WorkerClient` per (ingress replica, worker): a background task reads
the worker's step messages (over TCP, or a Ray streaming generator) and routes each
update to the queue of its request.
:meth:`WorkerClient.run` is the per-request view: submit, yield updates until
the request finishes, abort it if the caller stops listening first (or never starts:
serve/closing_stream.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import AsyncIterator

from radixray.cluster.errors import WorkerUnavailable, unwrap_ray_error
from radixray.cluster.messages import ChannelState, SubmitRequest
from radixray.cluster.step_socket import read_frame
from radixray.engine.messages import RequestUpdate
from radixray.serve.api_error import ApiError
from radixray.serve.closing_stream import ClosingStream

logger = logging.getLogger("radixray.ingress")

CONNECT_TIMEOUT_S = 5.0  # to reach a worker's step socket (else the channel goes over Ray)
HELLO_TIMEOUT_S = 60.0  # for its first message once connected (else the worker is unavailable)


class WorkerClient:
    """One channel to one worker. ``transport``: "tcp" reads the channel over a connection of
    its own (cluster/step_socket.py), falling back to Ray's streaming generator (logged) when
    the worker's endpoint cannot be reached; "ray" uses the generator."""

    def __init__(self, handle, worker_id: str, transport: str = "tcp"):
        self.handle = handle
        self.worker_id = worker_id
        self.transport = transport
        self.channel_id = f"ingress-{uuid.uuid4().hex[:12]}"
        self.draining = False
        self.alive = False
        self._queues: dict[str, asyncio.Queue] = {}
        self._gen = None
        self._writer: asyncio.StreamWriter | None = None
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Open the channel and wait for the worker's hello."""
        try:
            if self.transport != "tcp" or not await self._start_socket():
                await self._start_stream()
        except Exception as exc:  # the worker is dead or restarting
            raise WorkerUnavailable(f"cannot open a channel to engine worker {self.worker_id}: "
                                    f"{unwrap_ray_error(exc)}") from None
        self.alive = True

    async def _start_socket(self) -> bool:
        """The channel over TCP; False (logged) when the worker's endpoint is unreachable."""
        endpoint = await self.handle.open_socket_channel.remote(self.channel_id)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(endpoint.host, endpoint.port), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            logger.warning("worker %s: step messages over Ray instead of TCP (%s:%d not "
                           "reachable: %s)", self.worker_id, endpoint.host, endpoint.port,
                           exc or type(exc).__name__)
            return False
        self._writer = writer
        writer.write(endpoint.token.encode("ascii") + b"\n")
        try:
            hello = await asyncio.wait_for(read_frame(reader), HELLO_TIMEOUT_S)
        except BaseException:
            writer.close()
            raise
        self.draining = hello.draining
        self._tasks = [asyncio.create_task(self._read_socket(reader), name=f"pump-{self.worker_id}"),
                       asyncio.create_task(self._watch_actor(), name=f"watch-{self.worker_id}")]
        return True

    async def _start_stream(self) -> None:
        self._gen = self.handle.stream.options(num_returns="streaming").remote(self.channel_id)
        hello = await (await self._gen.__anext__())
        self.draining = hello.draining
        self._tasks = [asyncio.create_task(self._read_stream(), name=f"pump-{self.worker_id}")]

    async def _read_stream(self) -> None:
        error = "the engine worker's stream ended"
        try:
            async for ref in self._gen:
                self._route(await ref)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # worker died: every waiting request gets an error
            error = f"the engine worker failed: {unwrap_ray_error(exc)}"
            logger.error("worker %s channel closed: %s", self.worker_id, error)
        self._end(error)

    async def _read_socket(self, reader: asyncio.StreamReader) -> None:
        error = "the engine worker's stream ended"
        try:
            while True:
                self._route(await read_frame(reader))
        except asyncio.CancelledError:
            raise
        except asyncio.IncompleteReadError:
            pass  # the worker closed the channel (or its process went away)
        except Exception as exc:  # noqa: BLE001 - a broken connection or message
            error = f"the engine worker's channel broke: {type(exc).__name__}: {exc}"
            logger.error("worker %s channel closed: %s", self.worker_id, error)
        self._end(error)

    async def _watch_actor(self) -> None:
        """A TCP channel's reader learns of its worker's death from Ray too (a lost node
        closes no connection): then the connection is dropped, which ends the read."""
        try:
            await self.handle.wait_until_failed.remote()
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - RayActorError and friends: the actor is gone
            if self._writer is not None:
                self._writer.transport.abort()

    def _route(self, msg) -> None:
        """One channel message: the worker's draining state, or a step's updates to the
        queues of their requests."""
        if isinstance(msg, ChannelState):
            self.draining = msg.draining
            return
        for update in msg:
            q = self._queues.get(update.rid)
            if q is not None:
                q.put_nowait(update)

    def _end(self, error: str) -> None:
        self.alive = False
        for rid, q in list(self._queues.items()):
            q.put_nowait(RequestUpdate.failure(rid, error, status=None))

    async def close(self) -> None:
        if self._gen is not None:
            import ray
            ray.cancel(self._gen)
        if self._writer is not None:
            self._writer.close()
        for task in self._tasks:
            task.cancel()

    async def run(self, requests: list[SubmitRequest]) -> list[AsyncIterator[RequestUpdate]]:
        """Submit ``requests`` together; return one update iterator per request.

        Raises ApiError 400 for a request id already in flight on this channel, the worker's
        ValueError (bad input), WorkerDraining or WorkerUnavailable before anything streams.
        """
        if not self.alive:
            raise WorkerUnavailable(f"engine worker {self.worker_id} is not connected")
        refuse_rids_in_flight(requests, [self])
        queues = [asyncio.Queue() for _ in requests]
        for r, q in zip(requests, queues):
            self._queues[r.rid] = q
        try:
            await self.handle.submit.remote(self.channel_id, requests)
        except Exception as exc:
            for r in requests:
                self._queues.pop(r.rid, None)
            raise unwrap_ray_error(exc) from None
        return [ClosingStream(self._follow(r.rid, q), functools.partial(self._drop, r.rid))
                for r, q in zip(requests, queues)]

    def follows(self, rid: str) -> bool:
        """Whether a request ``rid`` of this channel is still in flight."""
        return rid in self._queues

    async def _follow(self, rid: str, q: asyncio.Queue) -> AsyncIterator[RequestUpdate]:
        finished = False
        try:
            while not finished:
                update = await q.get()
                finished = update.finished
                yield update
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.abort([rid])

    def _drop(self, rid: str) -> None:
        """A request whose stream was given up unread: stop following it, abort it."""
        if self._queues.pop(rid, None) is not None:
            self.abort([rid])

    def abort(self, rids: list[str]) -> None:
        """Fire-and-forget abort (the caller went away)."""
        if self.alive:
            self.handle.abort.remote(rids)


def refuse_rids_in_flight(requests: list[SubmitRequest], clients) -> None:
    """ApiError 400 naming ``rid`` when a request's id is in flight on one of ``clients``
    (a second reader of one id would take the first's updates, and one abort would end
    both)."""
    taken = next((r.rid for r in requests for c in clients if c.follows(r.rid)), None)
    if taken is not None:
        raise ApiError(400, f"rid {taken!r} is already in flight: request ids must be unique",
                       param="rid")
