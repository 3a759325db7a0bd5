"""Calls to the router actor that ride out its restarts.

The router is a restartable actor: when its process dies, Ray starts it again within a
second or two and the controller sends it the workers. A pick that meets the router
down waits for it (doubling sleeps, at most ``wait_s`` in all) instead of failing the
request; past that the caller gets :class:`RouterUnavailable` (HTTP 503). Releases are
fire-and-forget: a restarted router starts with no loads, so a lost release costs
nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time

from radixray.cluster.errors import WorkerUnavailable, actor_unreachable, unwrap_ray_error

logger = logging.getLogger("radixray.ingress")

ROUTER_WAIT_S = 20.0
FIRST_SLEEP_S = 0.1
MAX_SLEEP_S = 1.0


class RouterUnavailable(WorkerUnavailable):
    """The router actor stayed unreachable for ``wait_s`` (503, like an unreachable worker)."""


class RouterClient:
    """The router actor ``handle`` (an ``actors/router.py`` Router, or anything with the same
    ``pick``/``pick_pair``/``release`` remote methods) seen through typed calls: the picks
    wait through a restart, ``release`` does not wait."""

    def __init__(self, handle, wait_s: float = ROUTER_WAIT_S, sleep=asyncio.sleep):
        self.handle, self.wait_s, self._sleep = handle, wait_s, sleep
        self.waits = 0  # calls that met the router down and waited

    async def pick(self, text: str, session_id: str | None = None, exclude: list[str] = (),
                   retry: bool = False) -> tuple[str, str]:
        """(worker id, reason) for one request, none of ``exclude``; ``retry`` marks a second
        or later attempt. Raises NoWorkerAvailable, or RouterUnavailable (see the module)."""
        return await self._wait_through_restart(
            lambda: self.handle.pick.remote(text, session_id, list(exclude), retry))

    async def pick_pair(self, text: str, session_id: str | None = None,
                        exclude: list[str] = (), retry: bool = False) -> tuple[str, str, str]:
        """(prefill worker, decode worker, reason) for one disaggregated request; raises as
        :meth:`pick` does."""
        return await self._wait_through_restart(
            lambda: self.handle.pick_pair.remote(text, session_id, list(exclude), retry))

    async def _wait_through_restart(self, send):
        """``await send()``; its own exceptions unwrapped (NoWorkerAvailable, ...);
        RouterUnavailable when the actor stayed unreachable for ``wait_s``."""
        deadline, sleep, waited = time.monotonic() + self.wait_s, FIRST_SLEEP_S, False
        while True:
            try:
                return await send()
            except Exception as exc:
                if not actor_unreachable(exc):
                    raise unwrap_ray_error(exc) from None
                if time.monotonic() >= deadline:
                    raise RouterUnavailable(f"the router is unreachable after {self.wait_s:.0f} s:"
                                            f" {exc}") from None
                if not waited:
                    self.waits += 1
                    waited = True
                    logger.warning("router unreachable (%s); waiting for its restart",
                                   type(exc).__name__)
            await self._sleep(sleep)
            sleep = min(sleep * 2, MAX_SLEEP_S)

    def release(self, worker: str, ok: bool | None) -> None:
        """Return ``worker``'s load slot (``ok``: whether the request succeeded; None: it was
        not the worker's fault); fire-and-forget."""
        try:
            self.handle.release.remote(worker, ok)
        except Exception:  # noqa: BLE001 - a restarted router holds no load to release
            pass
