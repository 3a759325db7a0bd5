"""Update streams that clean up after themselves even when nobody read them.

A request's updates reach the ingress through async generators stacked three deep: the
worker channel's (:mod:`radixray.serve.worker_client`: abort the request if it is
unfinished), the dispatcher's (:mod:`radixray.serve.dispatch`: give the router its pick
back, retry elsewhere) and the HTTP response body. Each does its cleanup in a ``finally``
clause, which runs only if the generator started: closing or dropping an async generator
before its first ``__anext__`` runs none of its code. A client that goes away between
submit and the first read (or a pair whose other side refused, or a response cancelled
before it sent its first chunk) would leave the request running on its worker and its
router lease held.

:class:`ClosingStream` wraps such a generator with the cleanup its unread case needs:
``aclose()`` before the first read, or garbage collection of a stream never read, runs
``on_unread`` once. After the first read the generator's own ``finally`` is in charge
(``aclose()`` closes it; asyncio finalizes a started generator that is dropped).

A response body that reads its streams through a further generator (the frontend's
interleaving) must close that generator in its own ``finally`` (``contextlib.aclosing``):
left suspended, it would be closed only when the garbage collector and the event loop get
to it, and its requests would run on after their client went away until then.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable

logger = logging.getLogger("radixray.ingress")


class ClosingStream:
    """An async iterator over ``gen`` that runs ``on_unread`` (synchronous, may not raise)
    if it is closed or dropped before anything was read from it."""

    def __init__(self, gen: AsyncIterator, on_unread: Callable[[], None]):
        self._gen, self._on_unread = gen, on_unread
        self._started = self._discarded = False

    def __aiter__(self) -> ClosingStream:
        return self

    async def __anext__(self):
        if self._discarded:
            raise StopAsyncIteration
        self._started = True
        return await self._gen.__anext__()

    def discard(self) -> None:
        """Give up a stream not read yet: its cleanup runs now (once). A no-op once read."""
        if self._started or self._discarded:
            return
        self._discarded = True
        try:
            self._on_unread()
        except Exception:  # noqa: BLE001 - cleanup runs from finalizers too; never raise there
            logger.exception("cleaning up an unread update stream failed")

    async def aclose(self) -> None:
        if not self._started:
            self.discard()
        await self._gen.aclose()

    def __del__(self) -> None:
        self.discard()


def discard_all(streams: Iterable) -> None:
    """:meth:`ClosingStream.discard` on each stream that has it."""
    for s in streams:
        discard = getattr(s, "discard", None)
        if discard is not None:
            discard()


def response_stream(body: AsyncIterator, streams: list) -> ClosingStream:
    """A streamed response's ``body`` over its requests' update ``streams``: dropped or closed
    unread, it gives up every stream (which aborts the requests); read from, ``body``'s own
    ``finally`` closes them (the module docstring)."""
    return ClosingStream(body, lambda: discard_all(streams))
