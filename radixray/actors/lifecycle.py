"""Lifecycle of the fleet's restartable and detached actors.

:func:`reconstructed` tells an actor's constructor whether Ray is restarting it, and
:func:`after_rebuild` makes a restarted controller's methods wait for its rebuild.

Detached fleet actors stop themselves once their controller is gone for good.

Workers and the router are detached actors, so that they keep serving while the
controller restarts (a non-detached actor dies with its owner's process, restarts
included). The price is that nothing kills them if the controller dies without
stopping its fleet (killed with ``no_restart``, or out of restarts): each of them runs
:func:`watch_owner`, which asks the controller actor whether it is alive every few
seconds (by name) and kills its own actor once no live actor has that name (a
restarting controller is unavailable, not dead, and is waited for). The router, last,
also removes the fleet's placement group and checkpoint.
"""

from __future__ import annotations

import asyncio
import functools
import logging

logger = logging.getLogger("radixray.fleet")

WATCH_INTERVAL_S = 5.0
PING_TIMEOUT_S = 30.0
DEAD_CHECKS = 3  # consecutive "dead" answers before giving up (a call cut by a kill says dead)


async def watch_owner(owner: tuple[str, str], what: str, interval_s: float = WATCH_INTERVAL_S,
                      on_orphaned=None) -> None:
    """Loop until no live actor has the controller's name ``owner`` (name, namespace) for
    DEAD_CHECKS checks in a row; then call ``on_orphaned()`` (clean-up, may be a coroutine
    function) and kill the current actor. A controller created again under the same name
    (a new app deployment of the same fleet) counts as alive: it adopts this actor. ``what``
    names this actor in the log."""
    import ray
    from ray.exceptions import ActorDiedError
    name, namespace = owner
    dead = 0
    while dead < DEAD_CHECKS:
        await asyncio.sleep(interval_s)
        try:
            handle = ray.get_actor(name, namespace=namespace)
            await asyncio.wait_for(handle.__ray_ready__.remote(), PING_TIMEOUT_S)
            dead = 0
        except (ValueError, ActorDiedError):  # no such name, or its actor is dead
            dead += 1
        except Exception:  # noqa: BLE001 - restarting, slow or unreachable: not dead yet
            dead = 0
    logger.warning("%s: the fleet's controller %s is gone and will not restart: stopping",
                   what, name)
    if on_orphaned is not None:
        result = on_orphaned()
        if asyncio.iscoroutine(result):
            await result
    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def start_owner_watch(owner: tuple[str, str] | None, what: str, **kwargs) -> asyncio.Task | None:
    """:func:`watch_owner` as a task of the running loop (None without an owner or loop:
    an actor used directly in tests)."""
    if owner is None:
        return None
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return loop.create_task(watch_owner(owner, what, **kwargs), name="owner-watch")


def reconstructed() -> bool:
    """Whether Ray restarted the current actor after its process died (False outside an
    actor, and on an actor's first start)."""
    import warnings
    try:
        import ray
        if not ray.is_initialized():  # a plain object (tests): never start a Ray here
            return False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the property reads a deprecated attribute
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - not in an actor
        return False


def after_rebuild(method):
    """A public method that reads the registry: on a restarted controller it first waits
    for the rebuild from the running actors (callers see the whole fleet, never a half)."""
    @functools.wraps(method)
    async def wrapper(self, *args, **kwargs):
        task = self._start_task
        if self.restarted and task is not None and not task.done():
            await asyncio.shield(task)
        return await method(self, *args, **kwargs)
    return wrapper


async def every(interval_s: float, round_fn, what: str) -> None:
    """Await ``round_fn()`` every ``interval_s`` seconds, for ever: a failed round is logged
    (as ``what``) and the next one runs, so a control loop outlives any one bad round."""
    log = logging.getLogger("radixray.controller")
    while True:
        await asyncio.sleep(interval_s)
        try:
            await round_fn()
        except Exception:  # noqa: BLE001 - the loop must outlive any one bad round
            log.exception("%s failed", what)
