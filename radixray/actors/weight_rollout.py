"""One weight update across every live worker, all or none (the controller runs it).

Phases, each timed (returned and exported as ``radixray:weight_update_phase_seconds``,
``target`` model, or adapter for a LoRA adapter's update):

1. ``pause``: every worker pauses in the chosen mode (``retract`` by default; ``None``
   skips it: the new weights then go live between two steps, as after ``in_place``);
2. ``release``: optional memory release (only ``kv_cache``: staging the new weights
   reads the old ones, and the freed KV pool makes room for the staged copy);
3. ``transfer``: every worker opens a session and stages the weights (from disk, from
   tensors in shared memory or the object store, or from a trainer's broadcast: the
   source types of cluster/weight_sources.py);
4. ``load``: every worker prepares (fills rows not sent, repacks int8 layers);
5. ``commit``: every worker swaps the new weights in with the same version;
6. ``resume``: released memory comes back and generation continues.

A source with ``lora_name`` updates that LoRA adapter instead, by the same phases, under
the adapter's own version (actors/fleet_lora.py checks it and keeps the fleet's record).

If any worker fails before every commit succeeded, every session is dropped and every
worker that had committed rolls back, so all serve the old version, and the call
raises :class:`FleetUpdateFailed` naming the worker and its error. Memory and pause
are restored either way.

The version (an int or a string label, engine/weights/version.py) is checked against the
fleet's before phase 1, so a refused one (VersionRefused, a 400 naming weight_version over
HTTP) pauses nothing, transfers nothing and leaves no session open on any worker; the
caller sends the update again with a valid version. Every worker's own check passes then:
each serves the fleet's version, and its integer floor is the fleet's or lower.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

from radixray.cluster.errors import unwrap_ray_error
from radixray.cluster.metrics import WeightUpdateMetrics
from radixray.cluster.weight_sources import (
    DiskWeights,
    DistributedWeights,
    TensorWeights,
    WeightSource,
    check_source,
)
from radixray.engine.control import PAUSE_MODES, RELEASABLE_DURING_UPDATE
from radixray.engine.weights.version import (
    WeightVersion,
    check_version,
    default_version,
    raise_floor,
)

logger = logging.getLogger("radixray.controller")


class FleetUpdateFailed(RuntimeError):
    """A fleet-wide update failed on some worker; every worker serves the old weights."""


def stage(source: WeightSource, handle):
    """The worker call that stages ``source`` on ``handle`` (dispatched on its type)."""
    check_source(source)
    match source:
        case DiskWeights(path=path):
            return handle.update_weights_from_disk.remote(path)
        case TensorWeights(shared=None, payload=payload):
            return handle.update_weights_from_tensor.remote(payload)
        case TensorWeights(shared=shared, payload=payload):
            if payload is not None:  # for a worker off the shared file's node
                shared = dataclasses.replace(shared, elsewhere=(payload,))
            return handle.update_weights_from_tensor.remote(shared)
        case DistributedWeights(names=names, dtypes=dtypes, shapes=shapes, group_name=group):
            return handle.update_weights_from_distributed.remote(names, dtypes, shapes, group)


def check_plan(pause_mode: str | None, release: list[str]) -> None:
    if pause_mode is not None and pause_mode not in PAUSE_MODES:
        raise ValueError(f"pause_mode must be one of {PAUSE_MODES} or null, got {pause_mode!r}")
    bad = [t for t in release if t not in RELEASABLE_DURING_UPDATE]
    if bad:
        raise ValueError(f"release_memory may only hold {list(RELEASABLE_DURING_UPDATE)} during a "
                         f"weight update (the update reads the serving weights); got {bad}")
    if release and pause_mode not in ("abort", "retract"):
        raise ValueError("releasing kv_cache during an update needs pause_mode abort or retract "
                         "(running requests must not hold KV)")


async def _on_all(workers: dict, call) -> dict:
    """``call(handle)`` on every worker at once: results by worker id; FleetUpdateFailed
    naming every worker that raised."""
    ids = list(workers)
    results = await asyncio.gather(*(call(workers[w]) for w in ids), return_exceptions=True)
    errors = {w: str(unwrap_ray_error(r)) for w, r in zip(ids, results)
              if isinstance(r, BaseException)}
    if errors:
        raise FleetUpdateFailed("; ".join(f"{w}: {e}" for w, e in errors.items()))
    return dict(zip(ids, results))


async def _quietly(workers: dict, call) -> None:
    """Best-effort clean-up call on every worker (errors logged, not raised)."""
    ids = list(workers)
    results = await asyncio.gather(*(call(workers[w]) for w in ids), return_exceptions=True)
    for w, r in zip(ids, results):
        if isinstance(r, BaseException):
            logger.warning("weight update clean-up on %s failed: %s", w, unwrap_ray_error(r))


async def run_fleet_update(workers: dict, source: WeightSource, version: WeightVersion,
                           pause_mode: str | None = "retract", release: list[str] = (),
                           keep_paused: bool = False, phases: dict | None = None) -> dict:
    """Run the phases above on ``workers`` (worker id -> actor handle); returns
    ``{"weight_version", "workers", "phases"}``. Raises FleetUpdateFailed (all on the
    old version) or ValueError for a bad plan (nothing done). ``phases`` (the caller's
    dict) receives each phase's seconds, on failure too."""
    check_plan(pause_mode, list(release))
    if not workers:
        raise FleetUpdateFailed("no live worker to update")
    phases = {} if phases is None else phases
    committed: dict = {}

    async def timed(phase: str, call) -> dict:
        t0 = time.perf_counter()
        try:
            return await _on_all(workers, call)
        finally:
            phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - t0

    try:
        if pause_mode is not None:
            await timed("pause", lambda h: h.pause_generation.remote(pause_mode))
        if release:
            await timed("release", lambda h: h.release_memory_occupation.remote(list(release)))
        await timed("transfer", lambda h: h.begin_weight_update.remote(source.lora_name))
        await timed("transfer", lambda h: stage(source, h))
        await timed("load", lambda h: h.prepare_weight_update.remote(version))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(workers[w].commit_weight_update.remote() for w in workers),
                                       return_exceptions=True)
        phases["commit"] = time.perf_counter() - t0
        committed = {w: workers[w] for w, r in zip(workers, results)
                     if not isinstance(r, BaseException)}
        if len(committed) != len(workers):
            errors = {w: str(unwrap_ray_error(r)) for w, r in zip(workers, results)
                      if isinstance(r, BaseException)}
            raise FleetUpdateFailed("; ".join(f"{w}: {e}" for w, e in errors.items()))
        await _on_all(workers, lambda h: h.finish_weight_update.remote())
        committed = {}
    except BaseException as exc:
        logger.error("fleet weight update to version %r failed, keeping the old weights: %s",
                     version, exc)
        await _quietly(committed, lambda h: h.rollback_weight_update.remote())
        await _quietly(workers, lambda h: h.abort_weight_update.remote())
        raise
    finally:
        t0 = time.perf_counter()
        if release:
            await _quietly(workers, lambda h: h.resume_memory_occupation.remote(list(release)))
        if pause_mode is not None and not keep_paused:
            await _quietly(workers, lambda h: h.continue_generation.remote())
        phases["resume"] = time.perf_counter() - t0
    return {"weight_version": version, "workers": sorted(workers), "phases": phases}


@dataclass(frozen=True)
class OriginalWeights:
    """What a restarted worker replays when the fleet still serves the weights it loaded
    (no update ran, or only renames): nothing but the fleet's version name."""


class FleetWeights:
    """The fleet's weight version and its updates (one per controller).

    A worker (re)started after an update loads the original weights (version 0). Before
    it takes requests the controller calls :meth:`catch_up`: the last update is run again
    on that worker alone when it can be (a disk source; only the name when the weights
    are still the original ones); otherwise the worker stays out of routing (``stale``)
    until the next fleet-wide update brings it along, so no request is served by weights
    the fleet no longer has.
    """

    def __init__(self):
        self.version: WeightVersion = 0
        self.floor = 0  # the greatest int version the fleet served (engine/weights/version.py)
        self.lock = asyncio.Lock()  # one update (or catch-up) at a time
        self.metrics = WeightUpdateMetrics()
        self.stale: set[str] = set()  # live workers left behind by a restart
        # The last update, if a worker can repeat it (None when it cannot).
        self._replay: WeightSource | OriginalWeights | None = OriginalWeights()

    def saved(self) -> tuple[WeightVersion, WeightSource | OriginalWeights | None, set[str]]:
        """(version, the update a restarted worker replays, stale workers) to checkpoint."""
        return self.version, self._replay, set(self.stale)

    def restore(self, version: WeightVersion, replay: WeightSource | OriginalWeights | None,
                stale: set[str],
                floor: int = 0) -> None:
        """Take back :meth:`saved`'s state and the floor (a restarted controller)."""
        self.version, self._replay, self.stale = version, replay, set(stale)
        self.floor = raise_floor(floor, version)

    async def update(self, records: list, source: WeightSource,
                     weight_version: WeightVersion | None, pause_mode: str | None,
                     release: list[str], keep_paused: bool) -> dict:
        """Run one update on ``records`` (the live workers) from ``source``; set their
        versions on success. The version defaults to the next integer; a refused one raises
        VersionRefused before anything starts."""
        async with self.lock:
            version = check_version(default_version(self.floor) if weight_version is None
                                    else weight_version, self.floor)
            check_source(source)
            phases: dict[str, float] = {}
            try:
                result = await run_fleet_update({r.worker_id: r.handle for r in records}, source,
                                                version, pause_mode, list(release), keep_paused,
                                                phases)
            except FleetUpdateFailed:
                self.metrics.observe(phases, ok=False)
                raise
            self.metrics.observe(phases, ok=True)
            self.version, self.floor = version, raise_floor(self.floor, version)
            self._replay = source if isinstance(source, DiskWeights) else None
            for rec in records:
                rec.weight_version = version
            return result

    async def relabel(self, records: list, new_version: WeightVersion) -> dict:
        """Rename the weights the live workers serve (no transfer; SGLang's
        ``update_weight_version``); a stale worker keeps its own (other weights). A refused
        version raises VersionRefused before any worker is asked. The fleet takes the new
        name even when a worker fails (named in the FleetUpdateFailed): a restarted worker
        replays the last update under it."""
        async with self.lock:
            version = check_version(new_version, self.floor)
            previous = self.version
            records = [r for r in records if r.worker_id not in self.stale]
            ids = [r.worker_id for r in records]
            results = await asyncio.gather(*(r.handle.update_weight_version.remote(version)
                                             for r in records), return_exceptions=True)
            self.version, self.floor = version, raise_floor(self.floor, version)
            for rec, result in zip(records, results):
                if not isinstance(result, BaseException):
                    rec.weight_version = version
            errors = {w: str(unwrap_ray_error(r)) for w, r in zip(ids, results)
                      if isinstance(r, BaseException)}
            if errors:
                raise FleetUpdateFailed("; ".join(f"{w}: {e}" for w, e in errors.items()))
            logger.info("fleet weight version %r renamed %r", previous, version)
            return {"weight_version": version, "previous_version": previous,
                    "workers": sorted(ids)}

    async def catch_up(self, rec) -> str | None:
        """Bring a just-started worker to the fleet's version; None when it serves it, else
        why it cannot (it then belongs in :attr:`stale`)."""
        async with self.lock:
            self.stale.discard(rec.worker_id)
            if self.version == 0:
                return None
            if isinstance(self._replay, OriginalWeights):
                return await self._rename_one(rec)
            if self._replay is None:
                self.stale.add(rec.worker_id)
                return (f"serves weight version 0 while the fleet is at {self.version} (the last "
                        f"update came from a tensor or distributed source, which cannot be "
                        f"repeated for one worker): it takes requests after the next update")
            try:
                await rec.handle.begin_weight_update.remote()
                await stage(self._replay, rec.handle)
                await rec.handle.end_weight_update.remote(self.version)
            except Exception as exc:  # noqa: BLE001 - the worker stays out of routing
                await _quietly({rec.worker_id: rec.handle}, lambda h: h.abort_weight_update.remote())
                self.stale.add(rec.worker_id)
                return f"could not take weight version {self.version}: {unwrap_ray_error(exc)}"
            rec.weight_version = self.version
            logger.info("worker %s caught up to weight version %r", rec.worker_id, self.version)
            return None

    async def _rename_one(self, rec) -> str | None:
        """Catch-up when the fleet's weights are the original ones under another name."""
        try:
            await rec.handle.update_weight_version.remote(self.version)
        except Exception as exc:  # noqa: BLE001 - the worker stays out of routing
            self.stale.add(rec.worker_id)
            return f"could not take weight version {self.version!r}: {unwrap_ray_error(exc)}"
        rec.weight_version = self.version
        logger.info("worker %s renamed its weights %r", rec.worker_id, self.version)
        return None
