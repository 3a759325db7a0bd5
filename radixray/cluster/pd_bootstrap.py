"""The controller's bootstrap service for prefill-decode disaggregation.

Every prefill and decode worker registers its KV transfer endpoint (session and pool
layout) when it reports ready (``WorkerInfo``; kept on its registry record). Workers look
each other up through the controller (``Controller.worker``) to deliver room messages;
the KV itself moves between them directly.

The handshake proves the data path before the fleet reports ready: one ready prefill
worker writes its padding slot (slot 0, never read unmasked) into one ready decode
worker's padding slot over the real transport, every layer. The fleet is PD-ready while
both workers of the last successful handshake are still the incarnations it ran on, and
it runs again whenever that stops being true.
"""

from __future__ import annotations

import logging
import time

from radixray.cluster.errors import unwrap_ray_error

logger = logging.getLogger("radixray.controller")


class PDBootstrapService:
    def __init__(self):
        self._pair: tuple[str, int, str, int] | None = None  # (prefill, gen, decode, gen)
        self.last_error: str | None = None
        self.handshake_s: float | None = None
        self.handshakes = 0

    def ready_in(self, registry) -> bool:
        if self._pair is None:
            return False
        p, pg, d, dg = self._pair
        recs = {r.worker_id: r for r in registry.in_state("ready")}
        return p in recs and d in recs and recs[p].generation == pg and recs[d].generation == dg

    async def handshake(self, registry) -> bool:
        """Run the handshake between the first ready prefill and decode workers."""
        if self.ready_in(registry):
            return True
        ready = registry.in_state("ready")
        prefills = [r for r in ready if r.role == "prefill"]
        decodes = [r for r in ready if r.role == "decode"]
        self._pair = None
        if not prefills or not decodes:
            self.last_error = (f"needs a ready prefill and a ready decode worker "
                               f"({len(prefills)} and {len(decodes)} are ready)")
            return False
        p, d = prefills[0], decodes[0]
        t0 = time.perf_counter()
        try:
            await p.handle.pd_probe.remote(d.worker_id, d.kv_endpoint)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the fleet not PD-ready
            self.last_error = f"handshake {p.worker_id} -> {d.worker_id} failed: " \
                              f"{unwrap_ray_error(exc)}"
            logger.error("prefill-decode %s", self.last_error)
            return False
        self.handshake_s = time.perf_counter() - t0
        self.handshakes += 1
        self._pair = (p.worker_id, p.generation, d.worker_id, d.generation)
        self.last_error = None
        logger.info("prefill-decode handshake %s (%s) -> %s (%s) in %.1f ms", p.worker_id,
                    p.kv_session, d.worker_id, d.kv_session, self.handshake_s * 1e3)
        return True

    def status(self, registry) -> dict:
        """The ``/fleet`` and health view: routable workers by role, endpoints, handshake."""
        routable = set(registry.routable())
        by_role: dict[str, list[str]] = {"prefill": [], "decode": []}
        for r in registry:
            if r.role in by_role and r.worker_id in routable:
                by_role[r.role].append(r.worker_id)
        return {"ready": self.ready_in(registry) and all(by_role.values()),
                "prefill": by_role["prefill"], "decode": by_role["decode"],
                "endpoints": {r.worker_id: r.kv_session for r in registry if r.kv_session},
                "handshake": {"pair": list(self._pair[::2]) if self._pair else None,
                              "seconds": self.handshake_s, "count": self.handshakes,
                              "error": self.last_error}}
