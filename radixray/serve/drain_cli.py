"""``radixray drain``: finish the in-flight requests of every radixray fleet on a running Ray
cluster, refusing new ones, then return: what a Kubernetes preStop hook runs before the
pod's Ray processes get SIGTERM (k8s/rayservice.yaml), and what ``radixray serve`` runs
on SIGTERM (:func:`drain_fleet`)."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("radixray.serve")


def drain_fleet(controller, timeout: float | None, sleep=time.sleep) -> int:
    """Drain one fleet through its controller; returns the requests cut off by ``timeout``
    (None: wait for all)."""
    import ray
    remaining = ray.get(controller.drain_all.remote())
    deadline = None if timeout is None else time.monotonic() + timeout
    last_log = 0.0
    while remaining:
        if time.monotonic() - last_log >= 5:
            rids = ray.get(controller.inflight_rids.remote())
            logger.warning("Gracefully exiting... remaining requests: %d %s", remaining, rids)
            last_log = time.monotonic()
        if deadline is not None and time.monotonic() > deadline:
            logger.warning("drain timeout: %d request(s) cut off", remaining)
            return remaining
        sleep(0.25)
        remaining = ray.get(controller.num_inflight.remote())
    return 0


def fleet_controllers() -> list[tuple[str, object]]:
    """(name, handle) of every radixray controller on the connected cluster."""
    import ray
    from ray.util import list_named_actors
    out = []
    for entry in list_named_actors(all_namespaces=True):
        if "-controller-" in entry["name"]:
            try:
                out.append((entry["name"], ray.get_actor(entry["name"],
                                                         namespace=entry["namespace"])))
            except ValueError:  # gone meanwhile
                continue
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("drain", help="finish in-flight requests of every fleet on a running "
                       "Ray cluster, refusing new ones (a preStop hook)")
    p.add_argument("--address", default="auto", help="Ray cluster to join (default: auto)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds to wait for in-flight requests (default: no limit)")
    p.set_defaults(func=cmd_drain)


def cmd_drain(args) -> int:
    import ray
    if not ray.is_initialized():
        ray.init(address=args.address, logging_level=logging.WARNING)
    controllers = fleet_controllers()
    if not controllers:
        print("no radixray fleet on this cluster: nothing to drain")
        return 0
    cut = 0
    for name, handle in controllers:
        cut += drain_fleet(handle, args.timeout)
        print(f"{name}: drained" + (f" ({cut} request(s) cut off)" if cut else ""))
    return 0
