"""The ingress side of one EngineWorker channel.

One :class:`WorkerClient` per (ingress replica, worker): a background task reads
the worker's step messages and routes each update to the queue of its request.
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
from radixray.engine.messages import RequestUpdate
from radixray.serve.api_error import ApiError
from radixray.serve.closing_stream import ClosingStream

logger = logging.getLogger("radixray.ingress")


class WorkerClient:
    def __init__(self, handle, worker_id: str):
        self.handle = handle
        self.worker_id = worker_id
        self.channel_id = f"ingress-{uuid.uuid4().hex[:12]}"
        self.draining = False
        self.alive = False
        self._queues: dict[str, asyncio.Queue] = {}
        self._gen = None
        self._pump: asyncio.Task | None = None

    async def start(self) -> None:
        """Open the channel and wait for the worker's hello."""
        self._gen = self.handle.stream.options(num_returns="streaming").remote(self.channel_id)
        try:
            hello = await (await self._gen.__anext__())
        except Exception as exc:  # the worker is dead or restarting
            raise WorkerUnavailable(f"cannot open a channel to engine worker {self.worker_id}: "
                                    f"{unwrap_ray_error(exc)}") from None
        self.draining = hello.draining
        self.alive = True
        self._pump = asyncio.create_task(self._read(), name=f"pump-{self.worker_id}")

    async def _read(self) -> None:
        error = "the engine worker's stream ended"
        try:
            async for ref in self._gen:
                msg = await ref
                if isinstance(msg, ChannelState):
                    self.draining = msg.draining
                    continue
                for update in msg:
                    q = self._queues.get(update.rid)
                    if q is not None:
                        q.put_nowait(update)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # worker died: every waiting request gets an error
            error = f"the engine worker failed: {unwrap_ray_error(exc)}"
            logger.error("worker %s channel closed: %s", self.worker_id, error)
        self.alive = False
        for rid, q in list(self._queues.items()):
            q.put_nowait(RequestUpdate.failure(rid, error, status=None))

    async def close(self) -> None:
        if self._gen is not None:
            import ray
            ray.cancel(self._gen)
        if self._pump is not None:
            self._pump.cancel()

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
