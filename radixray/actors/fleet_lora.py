"""The fleet's LoRA adapters: which ones every worker serves, loaded and unloaded on every
live worker at once, and given to each worker the controller starts later.

The controller owns one :class:`FleetAdapters`. It starts from the engine section's
``lora_paths``; ``load`` and ``unload`` change it only when every live worker took the
change (a load refused by one worker is undone on the others, so the fleet never serves an
adapter on some workers only). A worker started or restarted afterwards gets the current
adapters as its ``lora_paths``. The adapters are part of the controller's checkpoint.

``update`` runs a fleet-wide weight-update session for one adapter (the rollout of
actors/weight_rollout.py with a source's ``lora_name``): every worker or none serves the
new weights, under the adapter's own version. A PEFT folder becomes the adapter's path for
workers started later; the ``.safetensors`` files applied since are replayed on them by
:meth:`FleetAdapters.catch_up`, which also stamps the version. An update from tensors or a
broadcast cannot be replayed: a worker started after it serves the adapter's last folder
as version 0 (a known gap, logged).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from radixray.actors.weight_rollout import FleetUpdateFailed, run_fleet_update
from radixray.cluster.errors import unwrap_ray_error
from radixray.cluster.metrics import WeightUpdateMetrics
from radixray.cluster.weight_sources import DiskWeights, WeightSource
from radixray.engine.weights.lora_options import parse_lora_path
from radixray.engine.weights.version import (
    WeightVersion,
    check_version,
    default_version,
    raise_floor,
)

logger = logging.getLogger("radixray.controller")


class FleetAdapters:
    """Adapter name -> path the fleet serves (see the module docstring)."""

    def __init__(self, adapters: dict[str, str] | None = None,
                 updates: dict[str, AdapterUpdates] | None = None):
        self.adapters: dict[str, str] = dict(adapters or {})
        self.updates: dict[str, AdapterUpdates] = dict(updates or {})  # adapters updated

    @classmethod
    def from_engine_options(cls, options: dict) -> FleetAdapters:
        return cls(dict(parse_lora_path(e) for e in options.get("lora_paths") or ()))

    def engine_options(self) -> dict:
        """What a worker started now gets: the current adapters as ``lora_paths``."""
        if not self.adapters:
            return {}
        return {"lora_paths": tuple(f"{n}={p}" for n, p in self.adapters.items())}

    async def load(self, records, lora_name: str, lora_path: str) -> dict:
        """Load on every live worker (``records``: their registry records); ValueError naming
        each worker that refused, after the others unloaded it again."""
        results = await _on_each(records, lambda h: h.load_lora_adapter.remote(lora_name,
                                                                              lora_path))
        errors = {w: r for w, r in results.items() if isinstance(r, BaseException)}
        if errors:
            loaded = [rec for rec in records if rec.worker_id not in errors]
            await _on_each(loaded, lambda h: h.unload_lora_adapter.remote(lora_name))
            raise ValueError("; ".join(f"{w}: {e}" for w, e in sorted(errors.items())))
        self.adapters[lora_name] = lora_path
        self.updates.pop(lora_name, None)
        logger.info("LoRA adapter %s loaded from %s on %d workers", lora_name, lora_path,
                    len(records))
        return {"lora_name": lora_name, "lora_path": lora_path, "workers": sorted(results)}

    async def unload(self, records, lora_name: str) -> dict:
        """Unload from every live worker; ValueError naming each worker that refused (an
        unknown adapter, or requests still using it there). The adapter leaves the fleet's
        list unless every worker refused because it does not know it."""
        if lora_name not in self.adapters:
            raise ValueError(f"unknown LoRA adapter {lora_name!r}; the fleet serves "
                             f"{sorted(self.adapters)}")
        results = await _on_each(records, lambda h: h.unload_lora_adapter.remote(lora_name))
        errors = {w: r for w, r in results.items() if isinstance(r, BaseException)}
        if len(errors) < len(results) or not results:
            self.adapters.pop(lora_name, None)
            self.updates.pop(lora_name, None)
        if errors:
            raise ValueError("; ".join(f"{w}: {e}" for w, e in sorted(errors.items())))
        logger.info("LoRA adapter %s unloaded from %d workers", lora_name, len(records))
        return {"lora_name": lora_name, "workers": sorted(results)}


    async def update(self, records, source: WeightSource, lora_version: WeightVersion | None,
                     pause_mode: str | None, release: list[str], keep_paused: bool,
                     lock: asyncio.Lock, metrics: WeightUpdateMetrics) -> dict:
        """Update adapter ``source.lora_name`` on every live worker (``records``), all or none,
        through weight-update sessions (actors/weight_rollout.py, under ``lock``: one fleet
        update at a time), as ``lora_version`` (None: the adapter's next int). ValueError
        naming an unknown adapter and VersionRefused before anything starts;
        FleetUpdateFailed with every worker on the old adapter. On success the fleet
        records the version and how a worker started later gets the same weights. Its
        phases and outcome go to ``metrics`` (the fleet's, as ``target="adapter"``)."""
        name = source.lora_name
        if name not in self.adapters:
            raise ValueError(f"unknown LoRA adapter {name!r}; the fleet serves "
                             f"{sorted(self.adapters)}")
        record = self.updates.get(name, AdapterUpdates())
        version = check_version(default_version(record.floor) if lora_version is None
                                else lora_version, record.floor,
                                f"the greatest integer version adapter {name!r} served so far")
        phases: dict[str, float] = {}
        async with lock:
            try:
                result = await run_fleet_update({r.worker_id: r.handle for r in records}, source,
                                                version, pause_mode, list(release), keep_paused,
                                                phases)
            except FleetUpdateFailed:
                metrics.observe(phases, ok=False, target="adapter")
                raise
            metrics.observe(phases, ok=True, target="adapter")
        replay = record.replay
        if isinstance(source, DiskWeights) and not source.path.endswith(".safetensors"):
            self.adapters[name], replay = source.path, []  # a whole adapter: start from it
        elif isinstance(source, DiskWeights) and replay is not None:
            replay = [*replay, source.path]
        else:
            replay = None
        self.updates[name] = AdapterUpdates(version, raise_floor(record.floor, version), replay)
        logger.info("LoRA adapter %s updated to version %r on %d workers", name, version,
                    len(records))
        result.pop("weight_version")
        return {"lora_name": name, "lora_version": version, **result}

    async def report_held(self, router, records, sampled_at: float) -> None:
        """Pass on to ``router`` the adapters each of ``records`` (live workers, their loads
        refreshed since ``time.monotonic()`` was ``sampled_at``) holds in its slots or queue,
        so the router's adapter affinity follows the workers rather than only its own picks.
        Nothing while the fleet serves no adapter; an unreachable router misses one report."""
        if not self.adapters or router is None:
            return
        held = {r.worker_id: list(r.load.adapters_held) for r in records if r.load is not None}
        try:
            await router.set_adapters_held.remote(held, time.monotonic() - sampled_at)
        except Exception as exc:  # noqa: BLE001 - a restarting router asks for the workers
            logger.debug("adapter report not delivered to the router: %s", unwrap_ray_error(exc))

    async def catch_up(self, rec) -> None:
        """Bring a just-started worker's adapters (loaded from :meth:`engine_options`) to the
        fleet's versions: the adapter files applied since its folder, under the version. An
        adapter last updated from tensors or a broadcast cannot be repeated: the worker
        serves it as loaded (its folder's weights, ``lora_version`` 0), which is logged."""
        for name, record in self.updates.items():
            if name not in self.adapters:
                continue
            if record.replay is None:
                logger.warning("worker %s serves LoRA adapter %s as loaded from %s (version 0): "
                               "the fleet's version %r came from tensors or a broadcast, which "
                               "cannot be repeated for one worker", rec.worker_id, name,
                               self.adapters[name], record.version)
                continue
            try:
                await rec.handle.begin_weight_update.remote(name)
                for path in record.replay:
                    await rec.handle.update_weights_from_disk.remote(path)
                await rec.handle.end_weight_update.remote(record.version)
            except Exception as exc:  # noqa: BLE001 - it serves the adapter as loaded
                await _on_each([rec], lambda h: h.abort_weight_update.remote())
                logger.warning("worker %s could not take LoRA adapter %s version %r: %s",
                               rec.worker_id, name, record.version, unwrap_ray_error(exc))
                continue
            logger.info("worker %s caught up to LoRA adapter %s version %r", rec.worker_id,
                        name, record.version)


@dataclass(frozen=True)
class AdapterUpdates:
    """What the fleet's updates of one adapter left: its version, the greatest int version
    it served, and the .safetensors files applied since its folder (None: an update a
    worker cannot repeat, from tensors or a broadcast)."""

    version: WeightVersion = 0
    floor: int = 0
    replay: list[str] | None = field(default_factory=list)


async def _on_each(records, call) -> dict:
    """``call(handle)`` on every record's worker: result or the (unwrapped) error by id."""
    results = await asyncio.gather(*(call(r.handle) for r in records), return_exceptions=True)
    return {r.worker_id: (unwrap_ray_error(x) if isinstance(x, BaseException) else x)
            for r, x in zip(records, results)}
