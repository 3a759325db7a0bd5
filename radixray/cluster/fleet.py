"""Where the ingress finds its engine worker(s).

Today a single named EngineWorker actor per app, created by the first ingress
replica that needs it (``get_if_exists``) and found by name by every other
replica and by the CLI (to drain it). The fleet issue moves ownership to a
controller actor; callers only use :func:`get_or_create_worker` and
:func:`find_worker`.
"""

from __future__ import annotations

from radixray.cluster.config import ServeConfig


def get_or_create_worker(cfg: ServeConfig, index: int = 0):
    """Handle of worker ``index``, starting it (and loading the model) if nobody has."""
    from radixray.actors.engine_worker import worker_actor_class
    worker_id = f"worker-{index}"
    return worker_actor_class().options(
        name=cfg.worker_name(index), namespace=cfg.namespace, get_if_exists=True,
        num_cpus=cfg.server.worker_num_cpus, num_gpus=cfg.server.worker_num_gpus,
        max_concurrency=1000,
    ).remote(cfg.engine.engine_options(), worker_id, cfg.server.warmup, cfg.server.log_level)


def find_worker(cfg: ServeConfig, index: int = 0):
    """Handle of a running worker, or None."""
    import ray
    try:
        return ray.get_actor(cfg.worker_name(index), namespace=cfg.namespace)
    except ValueError:
        return None
