"""The fleet's LoRA adapters: which ones every worker serves, loaded and unloaded on every
live worker at once, and given to each worker the controller starts later.

The controller owns one :class:`FleetAdapters`. It starts from the engine section's
``lora_paths``; ``load`` and ``unload`` change it only when every live worker took the
change (a load refused by one worker is undone on the others, so the fleet never serves an
adapter on some workers only). A worker started or restarted afterwards gets the current
adapters as its ``lora_paths``. The adapters are part of the controller's checkpoint.
"""

from __future__ import annotations

import asyncio
import logging

from radixray.cluster.errors import unwrap_ray_error
from radixray.engine.weights.lora_options import parse_lora_path

logger = logging.getLogger("radixray.controller")


class FleetAdapters:
    """Adapter name -> path the fleet serves (see the module docstring)."""

    def __init__(self, adapters: dict[str, str] | None = None):
        self.adapters: dict[str, str] = dict(adapters or {})

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
        if errors:
            raise ValueError("; ".join(f"{w}: {e}" for w, e in sorted(errors.items())))
        logger.info("LoRA adapter %s unloaded from %d workers", lora_name, len(records))
        return {"lora_name": lora_name, "workers": sorted(results)}


    async def update(self, records, lora_name: str, lora_path: str, version) -> dict:
        """Update the adapter in place on every live worker from ``lora_path`` (later
        workers load it from there); ValueError naming each worker that refused."""
        if lora_name not in self.adapters:
            raise ValueError(f"unknown LoRA adapter {lora_name!r}; the fleet serves "
                             f"{sorted(self.adapters)}")
        results = await _on_each(records, lambda h: h.update_lora_adapter.remote(
            lora_name, lora_path, None, version))
        errors = {w: r for w, r in results.items() if isinstance(r, BaseException)}
        if len(errors) < len(results):
            self.adapters[lora_name] = lora_path
        if errors:
            raise ValueError("; ".join(f"{w}: {e}" for w, e in sorted(errors.items())))
        return {"lora_name": lora_name, "workers": results}


async def _on_each(records, call) -> dict:
    """``call(handle)`` on every record's worker: result or the (unwrapped) error by id."""
    results = await asyncio.gather(*(call(r.handle) for r in records), return_exceptions=True)
    return {r.worker_id: (unwrap_ray_error(x) if isinstance(x, BaseException) else x)
            for r, x in zip(records, results)}
