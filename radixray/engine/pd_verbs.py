"""The engine's verbs for a prefill-decode pair (engine/disaggregation/): the KV endpoint a
peer writes into, room messages in and out, status and the handshake probe.

:class:`PDVerbs` is a mixin of :class:`radixray.engine.engine.Engine`; it reads ``self.pd``
(the pair's link, None on a unified engine) and ``self.worker_id``.
"""

from __future__ import annotations

from collections.abc import Callable

from radixray.engine.control import scheduler_verb


class PDVerbs:
    """Prefill-decode verbs of an engine (see the module docstring)."""

    pd = None
    worker_id: str

    def pd_endpoint(self):
        """The ``KVEndpoint`` a peer writes into (every rank's pool); None when unified."""
        return self.pd.endpoint if self.pd is not None else None

    def connect_pd_outbox(self, outbox: Callable[[str, object], None]) -> None:
        """``outbox(worker_id, message)`` delivers room messages to the other worker of a pair
        (called from the scheduler and sender threads; it must not block)."""
        self._pd_link().set_outbox(outbox)

    def pd_deliver(self, message) -> None:
        """A room message from the other worker of the pair (any thread)."""
        self._pd_link().deliver(message)

    def pd_undeliverable(self, message, error: str) -> None:
        """``message`` never reached its worker: a room waiting on the answer fails now."""
        self._pd_link().undeliverable(message, error)

    @scheduler_verb()
    def pd_status(self) -> dict:
        """Rooms of this side by state and in all, and whether a test stall holds the KV
        sender; {} when unified."""
        return self.pd.status() if self.pd is not None else {}

    def pd_probe(self, endpoint) -> float:
        """Handshake (prefill engine): write the padding slot of every rank's pool into the
        peer ``endpoint``'s, every layer; returns the seconds it took."""
        return self._pd_link().probe(endpoint)

    def _pd_link(self):
        if self.pd is None:
            raise ValueError(f"worker {self.worker_id} is unified: it takes no room messages")
        return self.pd
