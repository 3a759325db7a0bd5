"""The controller's record of every engine worker: identity, state, health, load.

States and who moves a worker between them (all on the controller)::

    starting --(model loaded, warmed up)--> ready <--resume-- draining
    ready --drain--> draining
    starting | ready | draining --(actor died, or its engine failed)--> dead --(restart)--> starting
    starting --(constructor failed)--> dead       (restarted like any death)
    dead --(restart budget spent or restarts off)--> failed
    ready --(autoscaler: drain, requests finished)--> removed from the registry

Only ``ready`` workers are routable. Plain Python: no Ray in here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from radixray.cluster.messages import WorkerLoad

STATES = ("starting", "ready", "draining", "dead", "failed")


@dataclass
class WorkerRecord:
    """One worker slot. ``worker_id`` and ``index`` (its placement bundle) survive restarts;
    ``generation`` counts the actor incarnations in this slot."""

    worker_id: str
    index: int
    role: str = "unified"
    state: str = "starting"
    handle: object = None
    generation: int = 0
    restarts: int = 0
    weight_version: int | str = 0  # a new incarnation serves the weights it loaded (0)
    started_at: float = field(default_factory=time.time)
    ready_at: float | None = None
    last_ping_at: float | None = None
    healthy: bool = True  # False while pings time out (the worker may only be busy)
    load: WorkerLoad | None = None  # last answer of EngineWorker.load()
    error: str | None = None  # why it last died
    kv_session: str | None = None  # prefill/decode: its driver rank's transfer session
    kv_endpoint: object | None = None  # prefill/decode: every rank's session and pool layout
    pid: int | None = None  # the actor's process id (on its node)
    node_ip: str | None = None  # the address of the Ray node it runs on
    tp_ranks: list | None = None  # each tensor-parallel rank's node address and process id
    placement_group: object = None  # an autoscaled fleet's worker: its own group (actors/placement.py)
    retiring: bool = False  # being drained away by the autoscaler: never restarted

    def set_state(self, state: str) -> None:
        if state not in STATES:
            raise ValueError(f"unknown worker state {state!r}; expected one of {STATES}")
        self.state = state
        if state == "ready" and self.ready_at is None:
            self.ready_at = time.time()

    def as_json(self) -> dict:
        return {"worker_id": self.worker_id, "index": self.index, "role": self.role,
                "state": self.state, "generation": self.generation, "restarts": self.restarts,
                "weight_version": self.weight_version, "started_at": self.started_at,
                "ready_at": self.ready_at, "last_ping_at": self.last_ping_at,
                "healthy": self.healthy, "load": self.load.as_json() if self.load else {},
                "error": self.error, "kv_session": self.kv_session, "pid": self.pid,
                "node_ip": self.node_ip, "tp_ranks": self.tp_ranks}


class Registry:
    """Worker records by id, in start order."""

    def __init__(self):
        self.records: dict[str, WorkerRecord] = {}

    def add(self, index: int, role: str = "unified") -> WorkerRecord:
        rec = WorkerRecord(worker_id=f"worker-{index}", index=index, role=role)
        self.records[rec.worker_id] = rec
        return rec

    def get(self, worker_id: str) -> WorkerRecord:
        try:
            return self.records[worker_id]
        except KeyError:
            raise KeyError(f"unknown worker {worker_id!r}; known: {sorted(self.records)}") from None

    def remove(self, worker_id: str) -> WorkerRecord:
        """Forget a worker slot (the autoscaler drained it away)."""
        return self.records.pop(worker_id)

    def __iter__(self):
        return iter(self.records.values())

    def in_state(self, *states: str) -> list[WorkerRecord]:
        return [r for r in self.records.values() if r.state in states]

    def routable(self) -> list[str]:
        """Ids of the workers that take new requests."""
        return [r.worker_id for r in self.in_state("ready")]

    def live(self) -> list[WorkerRecord]:
        """Workers with a running actor that serves or finishes requests."""
        return self.in_state("ready", "draining")

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in STATES}
        for r in self.records.values():
            out[r.state] += 1
        return out
