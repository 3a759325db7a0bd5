"""A worker channel's step messages over a TCP connection of its own (``server.step_transport``).

A channel carries one message per scheduler step from an engine worker to an ingress
replica (actors/engine_worker.py). Through Ray's streaming generator each message is a
Ray object reported to its owner: about 1 ms of CPU in each of the two processes per
message on a 2-vCPU host, which at batch 1 is per token, on the cores the engine decodes
on. Over a plain TCP connection the same message costs about a quarter of that
(docs/benchmarks.md, "Step messages over TCP").

The protocol, one connection per channel:

1. The ingress asks the worker over Ray for an endpoint (:meth:`StepSocketServer.offer`):
   the worker's node address, the port its listener got from the OS, and a one-time token.
2. The ingress connects and sends the token and a newline. A connection whose first line
   is not an offered token (or that sends none within :data:`TOKEN_TIMEOUT_S`) is closed.
3. The worker writes the channel's messages, each a :func:`frame`: a 4-byte little-endian
   length, then the message pickled. The ingress sends nothing more; its end of the
   connection closing is the reader going away (the worker aborts the channel's requests),
   the worker's closing is the channel's end.

Messages are pickled, as Ray's are: the ingress connects only to the endpoint a worker
gave it over Ray, and only a holder of the token is sent anything.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import secrets
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

logger = logging.getLogger("radixray.worker")

HEADER = struct.Struct("<I")
TOKEN_TIMEOUT_S = 10.0  # a connection must name its channel within this
OFFER_TTL_S = 120.0  # an endpoint not connected to within this is forgotten

Serve = Callable[[str, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass(frozen=True)
class SocketEndpoint:
    """Where one offered channel is read: connect to ``host``:``port``, send ``token``."""

    host: str
    port: int
    token: str
    channel_id: str


def frame(message) -> bytes:
    """``message`` as one frame: its pickle's length, then the pickle."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader):
    """The next message on ``reader``; ``asyncio.IncompleteReadError`` at the end."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return pickle.loads(await reader.readexactly(size))


class StepSocketServer:
    """A worker's listener for channels over TCP (see the module docstring).

    ``serve(channel_id, reader, writer)`` runs for each connection that presented an offered
    token, on the listener's event loop (the worker actor's); the connection is closed when
    it returns.
    """

    def __init__(self, host: str, serve: Serve):
        self.host, self._serve = host, serve
        self.port: int | None = None
        self._server: asyncio.base_events.Server | None = None
        self._starting = asyncio.Lock()
        self._offers: dict[str, tuple[str, float]] = {}  # token -> (channel id, offered at)

    async def offer(self, channel_id: str) -> SocketEndpoint:
        """A one-time endpoint for ``channel_id``; the first offer starts the listener."""
        async with self._starting:
            if self._server is None:
                self._server = await asyncio.start_server(self._accept, self.host, 0)
                self.port = self._server.sockets[0].getsockname()[1]
                logger.info("step messages over TCP: listening on %s:%d", self.host, self.port)
        now = time.monotonic()
        for token, (_, at) in list(self._offers.items()):
            if now - at > OFFER_TTL_S:
                del self._offers[token]
        token = secrets.token_hex(16)
        self._offers[token] = (channel_id, now)
        return SocketEndpoint(self.host, self.port, token, channel_id)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), TOKEN_TIMEOUT_S)
            offer = self._offers.pop(line.strip().decode("ascii", "replace"), None)
            if offer is None:
                logger.warning("step socket: a connection from %s named no offered channel; "
                               "closed", writer.get_extra_info("peername"))
                return
            await self._serve(offer[0], reader, writer)
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


async def write_messages(messages, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
    """Write each message of the async iterator ``messages`` to ``writer`` as a frame until it
    ends or the peer closes its end (read as EOF on ``reader``); then close ``messages``."""
    async def pump() -> None:
        async for message in messages:
            writer.write(frame(message))
            await writer.drain()

    pumping = asyncio.ensure_future(pump())
    peer_gone = asyncio.ensure_future(reader.read(1))  # the reader sends nothing: EOF when gone
    try:
        await asyncio.wait({pumping, peer_gone}, return_when=asyncio.FIRST_COMPLETED)
        error = pumping.exception() if pumping.done() and not pumping.cancelled() else None
        if error is not None and not isinstance(error, ConnectionError):
            logger.error("step socket: a channel's message could not be sent (%s: %s); the "
                         "channel closes", type(error).__name__, error)
    finally:
        for task in (pumping, peer_gone):
            task.cancel()
        await asyncio.gather(pumping, peer_gone, return_exceptions=True)
        await messages.aclose()
