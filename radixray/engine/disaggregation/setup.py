"""Make an engine one half of a prefill-decode pair: start its transport, register its KV
pool, create its side (:class:`PrefillSide` with a :class:`KVSender`, or
:class:`DecodeSide`) and give it to the scheduler."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from radixray.engine.disaggregation.decode import DecodeSide
from radixray.engine.disaggregation.messages import (
    CancelRoom,
    KVDestination,
    KVEndpoint,
    PDBootstrap,
    PeerGone,
)
from radixray.engine.disaggregation.prefill import PrefillSide
from radixray.engine.disaggregation.sender import KVSender
from radixray.engine.disaggregation.staging import SliceStager
from radixray.engine.disaggregation.tp_group import GroupWrites, open_rank_kv
from radixray.engine.faults import FaultInjector

logger = logging.getLogger("radixray.pd")

DIRECT_REQUEST_ERROR = (
    "this engine is the {mode} half of a prefill-decode pair: requests need a bootstrap room "
    "and arrive through the router. Do not send requests directly to prefill or decode "
    "workers; send them to the serving endpoint (radixray serve --prefill-workers P "
    "--decode-workers D) instead")


class PDLink:
    """One engine's disaggregation state: transport, layout, side and outbox.

    ``outbox(worker_id, message)`` delivers a message to another worker's engine; set it
    with :meth:`set_outbox` before requests arrive. It is called from the scheduler and
    sender threads and must not block. A message it cannot deliver is answered locally
    (``PeerGone``) when a room waits on it.
    """

    def __init__(self, mode: str, worker_id: str, scheduler, runner, config, transport=None):
        if mode not in ("prefill", "decode"):
            raise ValueError(f"disaggregation_mode must be 'prefill' or 'decode', got {mode!r}")
        self.mode, self.worker_id, self.scheduler = mode, worker_id, scheduler
        tp = runner.tp
        self.group = None  # a tensor-parallel prefill worker's followers write their shares
        if mode == "prefill" and tp.size > 1:
            self.group = GroupWrites(tp, config.disaggregation_transfer_host or "127.0.0.1",
                                     config.tp_timeout_s)
        kv = open_rank_kv(runner, config, transport, self.group and self.group.address)
        self.transport, self.layout, self.endpoint = kv.transport, kv.layout, kv.endpoint
        self._outbox: Callable[[str, object], None] | None = None
        self.sender: KVSender | None = None
        self.faults: FaultInjector | None = None  # tests only (attach_fault_injector)
        if mode == "prefill":
            pool = runner.kv_pool  # staged when decode ranks hold fewer heads than ours
            self.sender = KVSender(self.transport, self.endpoint, worker_id, scheduler.submit,
                                   self.send, self.group,
                                   SliceStager(self.transport, pool.k_buffers, pool.v_buffers))
            self.side = PrefillSide(scheduler, self.sender, self.send, worker_id,
                                    config.disaggregation_bootstrap_timeout_s)
        else:
            self.side = DecodeSide(scheduler, self.endpoint, self.send, worker_id,
                                   config.disaggregation_waiting_timeout_s)
        scheduler.attach_pd(self.side)
        logger.info("%s worker %s: KV transfer endpoint %s (%s), %d layers x %d bytes per slot"
                    "%s", mode, worker_id, self.transport.session, self.transport.protocol,
                    self.layout.num_layers, self.layout.slot_bytes,
                    f", {tp.size} ranks: {list(self.endpoint.sessions)}" if tp.size > 1 else "")

    @property
    def session(self) -> str:
        return self.transport.session

    def set_outbox(self, outbox: Callable[[str, object], None]) -> None:
        self._outbox = outbox

    def send(self, worker_id: str, message) -> None:
        if self._outbox is None:
            self.undeliverable(message, "no outbox is connected (the engine is not in a fleet)")
            return
        self._outbox(worker_id, message)

    def undeliverable(self, message, error: str) -> None:
        """``message`` never reached its worker: a room waiting on the answer fails now."""
        if isinstance(message, (KVDestination, CancelRoom)) and self.mode == "decode":
            self.scheduler.submit(PeerGone(message.room, f"unreachable: {error}"))
        else:
            logger.warning("%s for room %d not delivered: %s", type(message).__name__,
                           message.room, error)

    def deliver(self, message) -> None:
        """A message from the pair's other worker (any thread)."""
        self.scheduler.submit(message)

    def probe(self, endpoint: KVEndpoint) -> float:
        """Write every rank's padding slot 0 into the peer's slot 0, every layer and rank
        (a slot never read unmasked): proves transport, registration and layout. Returns
        the seconds. ValueError on a decode side (only the prefill side writes)."""
        if self.mode != "prefill":
            raise ValueError(f"worker {self.worker_id} is {self.mode}, not prefill")
        import torch
        error = self.endpoint.mismatch(endpoint)
        if error is not None:
            raise ValueError(error)
        zero = torch.zeros(1, dtype=torch.int64)
        t0 = time.perf_counter()
        self.sender.write(endpoint, zero, zero)
        return time.perf_counter() - t0

    def attach_fault_injector(self, faults: FaultInjector | None) -> None:
        """Tests: the KV sender asks ``faults`` before each write (None: detach)."""
        self.faults = faults
        if self.sender is not None:
            self.sender.faults = faults

    def status(self) -> dict:
        """Rooms of this side by state and in all, and whether a test stall holds the sender
        (scheduler thread)."""
        stalled = self.faults is not None and self.faults.kv_stalled
        return {**self.side.counts(), "rooms": len(self.side.rooms), "stalled": stalled}

    def snapshot(self) -> dict:
        """What a load snapshot carries of this side (scheduler thread); takes its finished
        transfers (each is reported once)."""
        side = self.side
        transfers = getattr(side, "transfers", [])
        snap = {"counts": side.counts(), "bootstrap_failed": side.bootstrap_failed,
                "transfer_failed": side.transfer_failed, "transfers": list(transfers)}
        transfers.clear()
        return snap

    def check_request(self, pd: PDBootstrap | None) -> None:
        if pd is None:
            raise ValueError(DIRECT_REQUEST_ERROR.format(mode=self.mode))

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.transport.close()
