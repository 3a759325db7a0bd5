"""RouterActor: the fleet's one routing state (prefix tree, loads, circuits, sessions).

A thin async actor around :class:`radixray.cluster.routing.Router`. Every
ingress replica asks it for a worker (``pick``), or for a prefill and a decode
worker in a disaggregated fleet (``pick_pair``: the prefill worker by the
configured policy over the prefill workers' prefix tree, the decode worker by
least load), and reports back when the request ends (``release``, once per
worker picked), so all replicas share one tree and one load view.
Calls run one at a time on the actor's event loop; none blocks on I/O. A
background task runs the tree's LRU eviction every ``eviction_interval_s``.

The router is a detached, restartable actor (it outlives a controller restart). When
Ray restarts it, it starts with an empty tree and no loads, asks the controller to send
the routable workers again, and holds picks until they arrive (at most
``VIEW_WAIT_S``); the prefix tree then refills from traffic. The policy set at run time
comes back with the workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter

from radixray.actors.fleet_checkpoint import release_orphaned
from radixray.actors.lifecycle import reconstructed, start_owner_watch
from radixray.cluster.metrics import router_families
from radixray.cluster.routing import NoWorkerAvailable, Router, RouterSettings

logger = logging.getLogger("radixray.router")

VIEW_WAIT_S = 10.0  # a restarted router waits this long for the controller's worker list
REPUBLISH_TRIES = 5


class RouterActor:
    def __init__(self, settings: RouterSettings, controller=None,
                 owner: tuple[str, str] | None = None):
        """``controller``: the fleet controller's handle (a restarted router asks it for the
        workers); ``owner``: its (name, namespace): once no controller has that name for
        good, the router releases the fleet's placement group and stops."""
        self.router = Router(settings)  # unified workers, or the prefill workers
        self.decode = Router(dataclasses.replace(settings, policy="least_load"))
        self.roles: dict[str, str] = {}
        self.pairs: Counter[str] = Counter()
        self.retries = 0
        self.restarted = reconstructed()
        self._evictor: asyncio.Task | None = None
        self._view = asyncio.Event()  # set once the controller sent the workers
        watch = start_owner_watch(owner, "router", on_orphaned=lambda: release_orphaned(owner[0]))
        self._tasks = [watch] if watch is not None else []
        if self.restarted and controller is not None:
            logger.warning("router restarted: prefix tree and loads start empty; asking the "
                           "controller for the workers")
            self._tasks.append(asyncio.get_running_loop().create_task(
                self._ask_for_workers(controller)))

    async def _ask_for_workers(self, controller) -> None:
        """A restarted router asks the controller to send the workers again (the controller
        may itself be restarting: it publishes once it has rebuilt, so a few tries do)."""
        for attempt in range(REPUBLISH_TRIES):
            try:
                await controller.republish.remote()
                return
            except Exception as exc:  # noqa: BLE001 - restarting controller: try again
                logger.warning("router: asking the controller for the workers failed (%s)",
                               type(exc).__name__)
                await asyncio.sleep(1.0 + attempt)

    async def _wait_for_view(self) -> None:
        if self.restarted and not self._view.is_set():
            try:
                await asyncio.wait_for(self._view.wait(), VIEW_WAIT_S)
            except asyncio.TimeoutError:
                pass

    def _ensure_evictor(self) -> None:
        if self._evictor is None:
            self._evictor = asyncio.get_running_loop().create_task(self._evict_loop())

    async def _evict_loop(self) -> None:
        interval = self.router.settings.eviction_interval_s
        while True:
            await asyncio.sleep(interval)
            removed = self.router.maybe_evict()
            if removed:
                logger.info("router tree eviction removed %d characters", removed)

    async def pick(self, text: str, session_id: str | None = None, exclude: list[str] = (),
                   retry: bool = False) -> tuple[str, str]:
        """(worker id, reason) for one request; raises NoWorkerAvailable. ``retry`` marks
        a second or later attempt of a request (counted in the retries metric)."""
        self._ensure_evictor()
        await self._wait_for_view()
        if retry:
            self.retries += 1
        decision = self.router.pick(text, session_id, exclude)
        return decision.worker, decision.reason

    async def pick_pair(self, text: str, session_id: str | None = None, exclude: list[str] = (),
                        retry: bool = False) -> tuple[str, str, str]:
        """(prefill worker, decode worker, reason) for one disaggregated request; raises
        NoWorkerAvailable naming the role that has no candidate."""
        self._ensure_evictor()
        await self._wait_for_view()
        if retry:
            self.retries += 1
        prefill = self.router.pick(text, session_id, exclude)
        try:
            decode = self.decode.pick(text, None, exclude)
        except NoWorkerAvailable as exc:
            self.router.release(prefill.worker, None)
            raise NoWorkerAvailable(f"no decode worker: {exc}") from None
        self.pairs[f"{prefill.worker}->{decode.worker}"] += 1
        return prefill.worker, decode.worker, prefill.reason

    async def release(self, worker: str, ok: bool | None) -> None:
        (self.decode if self.roles.get(worker) == "decode" else self.router).release(worker, ok)

    async def set_workers(self, workers: list[str], roles: dict[str, str] | None = None,
                          policy: str | None = None) -> None:
        """The routable workers; ``roles`` (worker -> unified | prefill | decode) splits
        them between the pick and the decode pool; ``policy``: the fleet's routing policy
        (the controller sends it along, so a restarted router keeps one set at run time)."""
        if policy is not None and policy != self.router.settings.policy:
            await self.set_policy(policy)
        self.roles = dict(roles or {})
        self.router.set_workers([w for w in workers if self.roles.get(w) != "decode"])
        self.decode.set_workers([w for w in workers if self.roles.get(w) == "decode"])
        self._view.set()

    async def set_policy(self, policy: str) -> None:
        self.router.set_policy(policy)
        logger.info("routing policy set to %s", policy)

    async def set_weight_versions(self, versions: dict[str, int | str]) -> list[str]:
        self.decode.set_weight_versions(versions)
        changed = self.router.set_weight_versions(versions)
        if changed:
            logger.info("router forgot the prefixes of %s (new weight version)", ", ".join(changed))
        return changed

    async def set_adapters_held(self, held: dict[str, list[str]], age_s: float = 0.0) -> None:
        """The workers' reports of the LoRA adapters they hold (Router.set_adapters_held)."""
        self.router.set_adapters_held(held, age_s)
        self.decode.set_adapters_held(held, age_s)

    async def forget_prefixes(self) -> None:
        self.router.forget_prefixes()

    async def state(self) -> dict:
        out = {**self.router.state(), "retries": self.retries, "restarted": self.restarted}
        if "decode" in self.roles.values():
            out["decode"] = self.decode.state()
            out["pairs"] = dict(self.pairs)
        return out

    async def metric_families(self) -> list:
        return router_families(self.router.state(), self.retries)


def router_actor_class():
    import ray
    return ray.remote(RouterActor)
