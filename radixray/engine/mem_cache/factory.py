"""Building the KV manager an engine's config asks for: the plain radix cache, or the
hierarchical cache's tiers under it."""

from __future__ import annotations

from radixray.engine.mem_cache.kv_manager import KVManager
from radixray.engine.mem_cache.radix_cache import RadixCache


def create_kv_manager(config, runner) -> KVManager:
    """The KV manager an engine of ``config`` runs: the radix cache over the runner's pool,
    with the hierarchical cache's host and storage tiers when enable_hierarchical_cache."""
    cache = RadixCache(runner.allocator, disable=config.disable_radix_cache,
                       eviction_policy=config.radix_eviction_policy)
    if not config.enable_hierarchical_cache:
        return KVManager(runner.allocator, runner.req_pool, cache)
    from radixray.engine.mem_cache.hicache.manager import HiCacheKVManager  # only when asked for
    return HiCacheKVManager.create(config, runner, cache)
