"""Where callers find the fleet: the controller actor of an app (and through it the router
and the workers).

The first ingress replica creates the controller (a named, detached actor,
``get_if_exists``), unless ``radixray serve`` already has (:func:`prestart_fleet`); every
other replica, the CLI (to drain) and admin scripts find it by name. The name carries
:meth:`ServeConfig.fleet_key`, so a redeploy that changes the fleet's shape starts a new
fleet, and the old one stops itself when its replicas stop sending heartbeats
(:func:`start_heartbeats`).
"""

from __future__ import annotations

from radixray.cluster.config import ServeConfig


def get_or_create_controller(cfg: ServeConfig):
    """Handle of the app's controller, creating it if nobody has (call ``start`` on it).
    Ray restarts it after its process dies (``fleet.actor_max_restarts``)."""
    from radixray.actors.controller import controller_actor_class
    return controller_actor_class().options(
        name=cfg.controller_name(), namespace=cfg.namespace, get_if_exists=True, num_cpus=0,
        max_concurrency=1000, lifetime="detached", max_restarts=cfg.fleet.actor_max_restarts,
    ).remote(cfg.model_dump())


def prestart_fleet(cfg: ServeConfig, owner: str):
    """Start the app's fleet now, before Serve deploys its ingress: the controller, router
    and workers start while Serve starts its own controller, proxy and replicas, and a
    replica then finds this controller by name and waits on the same start (``radixray
    serve`` of a tiny model: 21.8 s from launch to ready instead of 26.1 s,
    docs/benchmarks.md). Until the ingress replicas send heartbeats, ``owner`` (the caller:
    the ``radixray serve`` command, a test) keeps the fleet alive with its own; set the
    returned ``threading.Event`` once the app answers /ready. A fleet whose app never comes
    up stops ``fleet.owner_timeout_s`` after its owner stops beating (or its process ends)."""
    controller = get_or_create_controller(cfg)
    beats = start_heartbeats(controller, owner, owner_beat_interval(cfg))
    controller.start.remote()  # its errors reach the ingress, which waits on the same start
    return beats


def owner_beat_interval(cfg: ServeConfig) -> float:
    """Seconds between an owner's heartbeats: four a timeout, at most 5 s apart."""
    return min(5.0, cfg.fleet.owner_timeout_s / 4)


def find_controller(cfg: ServeConfig):
    """Handle of the running controller, or None."""
    import ray
    try:
        return ray.get_actor(cfg.controller_name(), namespace=cfg.namespace)
    except ValueError:
        return None


def find_router(cfg: ServeConfig):
    """Handle of the running router (the controller creates it during ``start``), or None."""
    import ray
    try:
        return ray.get_actor(cfg.router_name(), namespace=cfg.namespace)
    except ValueError:
        return None


def start_heartbeats(controller, owner: str, interval_s: float, families=None):
    """Tell ``controller`` every ``interval_s`` that ``owner`` (an ingress replica, a job)
    still uses it: a daemon thread that beats while the replica's constructor blocks and
    dies with the process. ``families``: a callable whose Prometheus families ride along
    (an ingress replica's HTTP series; the controller serves them on every replica's
    /metrics). Returns a ``threading.Event``: set it to stop beating. It also stops once
    this process has left Ray (a remote call would start a new local Ray)."""
    import threading

    import ray
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set() and ray.is_initialized():
            try:
                controller.heartbeat.remote(owner, families() if families else None)
            except Exception:  # noqa: BLE001 - the controller may be restarting; keep beating
                pass
            stop.wait(interval_s)
    threading.Thread(target=beat, name="controller-heartbeat", daemon=True).start()
    return stop
