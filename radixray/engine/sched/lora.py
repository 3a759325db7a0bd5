"""LoRA in the scheduler: the adapters running requests hold, the per-batch adapter cap at
admission, and new requests taking their adapter's current weights (or failing when it was
unloaded before they arrived).

A decode step runs every running request, so the distinct adapters of the running and
chunked requests plus those a prefill admits must fit ``max_loras_per_batch`` slots
(engine/weights/lora_slots.py); a waiting request of one more adapter waits (others behind
it may still start), as in SGLang.
"""

from __future__ import annotations

from radixray.engine.request import Req
from radixray.engine.sched.queues import RequestQueues


def active_adapters(queues: RequestQueues) -> set[str]:
    """Adapters of the running requests and the chunked one (their slots stay)."""
    reqs = list(queues.running) + ([queues.chunked] if queues.chunked is not None else [])
    return {r.lora for r in reqs if r.lora is not None}


def held_adapters(scheduler) -> list[str]:
    """The adapters ``scheduler``'s engine holds or is about to: those in its device slots
    (least recently used first), then those of waiting requests that are not (in queue
    order). What the router's adapter affinity learns from (``WorkerLoad.adapters_held``);
    empty without LoRA. Scheduler thread."""
    slots = getattr(scheduler.runner, "lora", None)
    if slots is None:
        return []
    held = slots.resident()
    for req in scheduler.queues.waiting:
        if req.lora is not None and req.lora not in held:
            held.append(req.lora)
    return held


class AdapterAdmission:
    """One prefill build's adapter count: ``admits`` says whether ``req`` fits the slots
    beside the adapters already active or admitted; ``add`` records an admitted one."""

    def __init__(self, limit: int | None, active: set[str]):
        self.limit = limit
        self.active = set(active)

    def admits(self, req: Req) -> bool:
        return (self.limit is None or req.lora is None or req.lora in self.active
                or len(self.active) < self.limit)

    def add(self, req: Req) -> None:
        if req.lora is not None:
            self.active.add(req.lora)


def adopt_adapter(req: Req, slots) -> str | None:
    """A new request takes its adapter's weights serving now (their radix-cache namespace
    and version: the adapter may have been updated since the request was validated).
    Returns why it cannot run (the adapter was unloaded meanwhile), or None."""
    if req.lora is None:
        return None
    ns = slots.namespace(req.lora) if slots is not None else None
    if ns is None:
        return f"LoRA adapter {req.lora!r} was unloaded"
    req.lora_ns, req.lora_version = ns, slots.version(req.lora)
    return None
