"""HiCache: the radix cache over three tiers (device pool L1, host tier L2, storage L3).

The host tier is a second :class:`RadixCache` whose slots index :class:`HostKVPool` rows.
A device-tree node's host copy is the host-tree node at the same token path: the two
trees share keys, not nodes, so each keeps the device cache's ownership, locking and
eviction contract unchanged, and each tier evicts its own least recently used leaves.

When a prefix gets its host copy is the write policy's choice:

* ``write_through``: whenever a request's KV enters the device tree (after a prefill
  chunk, at the end).
* ``write_through_selective``: only the part of that path a second request has used
  (its device nodes have been matched at least once).
* ``write_back``: when the device tree evicts a leaf (:attr:`RadixCache.on_evict`).

With a storage backend, every host copy also writes the prefix's whole pages to L3 (write
through to storage, so the file tier outlives the process and is shared by engines).

Load-back (:meth:`HiCacheKVManager.prepare_admission`, before each prefill batch is
built): for the requests at the head of the queue whose device match is shorter than their
host or storage match, the missing tokens are read (storage pages into host rows, host rows
into fresh device slots) and inserted into the device tree, so admission matches them as
device hits. The device path being extended and the host path being read are locked while
slots are allocated, and the prefixes loaded for earlier requests stay locked until the
batch is built, so a load-back only evicts unlocked least-recently-used device leaves, never
what the batch or another load-back holds; it is skipped when the free plus evictable
slots cannot hold it, and one step loads at most max_prefill_tokens.

KV conservation holds per tier: device free + request-held + cache-held == device pool,
and host free + host-tree-held == host pool.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch

from radixray.engine.mem_cache.hicache.host_pool import HostKVPool
from radixray.engine.mem_cache.hicache.storage import (
    PAGE_TOKENS,
    StorageBackend,
    create_storage,
    page_hashes,
)
from radixray.engine.mem_cache.kv_manager import KVManager
from radixray.engine.mem_cache.pool import TokenSlotAllocator
from radixray.engine.mem_cache.radix_cache import MatchResult, RadixCache
from radixray.engine.request import Req

logger = logging.getLogger(__name__)

HOST_MEMORY_FRACTION = 0.8  # the most of the available host memory the host tier may take
MAX_PREPARED_REQS = 16  # waiting requests looked at for load-back per step


@dataclass
class HiCacheStats:
    """Monotonic counters (metrics). ``*_hit_tokens`` count prompt tokens of admitted
    requests whose KV came from that tier; ``*_hits`` the requests that had such tokens."""

    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    host_hits: int = 0
    storage_hits: int = 0
    backup_tokens: int = 0  # tokens copied device -> host
    storage_pages_written: int = 0
    storage_pages_read: int = 0


@dataclass
class _Loaded:
    end: int  # the request's prefix is on the device up to here
    host: int  # of which tokens came from the host tier
    storage: int  # and from the storage tier


class HiCacheKVManager(KVManager):
    """:class:`KVManager` with a host tier (and optionally storage) under the device tree."""

    def __init__(self, allocator: TokenSlotAllocator, req_pool, cache: RadixCache, kv_pool,
                 host: HostKVPool, write_policy: str, storage: StorageBackend | None = None,
                 namespace: str = "", max_load_tokens: int = 16384):
        super().__init__(allocator, req_pool, cache)
        self.kv_pool = kv_pool
        self.host = host
        self.host_alloc = TokenSlotAllocator(host.size)
        self.host_cache = RadixCache(self.host_alloc, eviction_policy=cache.eviction_policy)
        self.write_policy = write_policy
        self.storage = storage
        self._namespace_base = namespace
        self.max_load_tokens = max_load_tokens
        self.stats = HiCacheStats()
        self._loaded: dict[str, _Loaded] = {}
        if write_policy == "write_back":
            cache.on_evict = self._backup_node

    @classmethod
    def create(cls, config, runner, cache: RadixCache) -> HiCacheKVManager:
        """Size the host tier from hicache_size or hicache_ratio (ValueError naming the
        option when it exceeds HOST_MEMORY_FRACTION of the available host memory) and log it."""
        from radixray.engine.executor.model_runner import available_memory_bytes

        pool = runner.kv_pool
        probe = HostKVPool(0, pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype,
                           config.hicache_host_dtype)
        if config.hicache_size is not None:
            size, source = int(config.hicache_size * 2**30) // probe.bytes_per_token, "hicache_size"
        else:
            size, source = int(config.hicache_ratio * runner.max_total_tokens), "hicache_ratio"
        nbytes = size * probe.bytes_per_token
        limit = HOST_MEMORY_FRACTION * available_memory_bytes("cpu")
        if size < 1 or nbytes > limit:
            raise ValueError(
                f"{source}={getattr(config, source)} gives a host KV tier of {size} tokens "
                f"({nbytes / 2**30:.2f} GiB); it must hold at least one token and fit in "
                f"{HOST_MEMORY_FRACTION:.0%} of the available host memory ({limit / 2**30:.2f} GiB)")
        host = HostKVPool(size, pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype,
                          config.hicache_host_dtype, pin=pool.device.type == "cuda")
        storage = create_storage(config.hicache_storage_backend, config.hicache_storage_dir)
        namespace = (f"{config.model}|{str(pool.dtype)}|{config.hicache_host_dtype}|"
                     f"{host.row_shape}|{PAGE_TOKENS}")
        logger.info(
            "HiCache: host KV pool of %d tokens (%.1f MiB, %s layout, %.2fx the device pool's "
            "%d tokens), write policy %s, storage %s", size, nbytes / 2**20, host.dtype,
            size / runner.max_total_tokens, runner.max_total_tokens, config.hicache_write_policy,
            config.hicache_storage_backend or "none")
        return cls(runner.allocator, runner.req_pool, cache, pool, host,
                   config.hicache_write_policy, storage, namespace, config.max_prefill_tokens)

    # ------------------------------------------------------------------ host copies
    def _alloc(self, allocator: TokenSlotAllocator, cache: RadixCache, n: int):
        """``n`` slots of one tier, evicting its unlocked LRU leaves if needed; None, having
        evicted nothing, when free + evictable cannot cover ``n``."""
        if n > allocator.available_size() + cache.evictable_size():
            return None
        slots = allocator.alloc(n)
        if slots is None:
            cache.evict(n - allocator.available_size())
            slots = allocator.alloc(n)
        return slots

    def _backup(self, key: list[int], dev_slots: torch.Tensor) -> None:
        """Give ``key`` (whose device KV is at ``dev_slots``) a host copy of the part the
        host tree lacks; skipped when the host tier cannot free room."""
        m = self.host_cache.match_prefix(key)
        have = len(m.slots)
        if have >= len(key):
            return
        self.host_cache.inc_lock_ref(m.last_node)  # host eviction must spare the path we extend
        try:
            new = self._alloc(self.host_alloc, self.host_cache, len(key) - have)
        finally:
            self.host_cache.dec_lock_ref(m.last_node)
        if new is None:
            return
        self.host.store(self.kv_pool, dev_slots[have:], new)
        host_slots = torch.cat((m.slots, new))
        already = self.host_cache.insert(key, host_slots)
        assert already == have, (already, have)
        self.stats.backup_tokens += len(new)
        if self.storage is not None:
            self._write_pages(key, host_slots, have // PAGE_TOKENS)

    def _backup_node(self, node) -> None:
        """write_back: the device tree is about to evict ``node``."""
        self._backup(*self.cache.path_of(node))

    def _insert(self, req: Req) -> None:
        super()._insert(req)
        if self.write_policy == "write_back":
            return
        key = req.cache_key(req.kv_len)
        path = self.cache.walk(key)
        if self.write_policy == "write_through_selective":
            path = path[:next((i for i, (node, _) in enumerate(path) if node.hit_count < 1),
                              len(path))]
        n = sum(k for _, k in path)
        if n:
            self._backup(key[:n], torch.cat([node.slots[:k] for node, k in path]))

    # ------------------------------------------------------------------ storage tier
    @property
    def namespace(self) -> str:
        # the cache's generation, not the user's version label: one label may name two
        # different weights (SGLang's clients repeat it on every bucket of an update)
        return f"{self._namespace_base}|v{self.cache.version}"

    def _write_pages(self, key: list[int], host_slots: torch.Tensor, first_page: int) -> None:
        """Store ``key``'s whole pages from ``first_page`` on (their host rows are ``host_slots``)."""
        num_pages = len(key) // PAGE_TOKENS
        if num_pages <= first_page:
            return
        for i, h in enumerate(page_hashes(self.namespace, key, num_pages)[first_page:], first_page):
            if not self.storage.exists(h):
                self.storage.set(h, self.host.export(host_slots[i * PAGE_TOKENS:(i + 1) * PAGE_TOKENS]))
                self.stats.storage_pages_written += 1

    def _storage_has(self, key: list[int], pos: int) -> bool:
        """Whether the storage tier holds the whole page of ``key`` that token ``pos`` is in."""
        page = pos // PAGE_TOKENS
        if len(key) < (page + 1) * PAGE_TOKENS:
            return False
        return self.storage.exists(page_hashes(self.namespace, key, page + 1)[page])

    def _read_pages(self, key: list[int], have: int) -> int:
        """Extend the host tree's copy of ``key`` (``have`` tokens long) with the whole pages
        the storage tier holds after it; returns the host match length afterwards."""
        first, last = have // PAGE_TOKENS, len(key) // PAGE_TOKENS
        if last <= first:
            return have
        hashes = page_hashes(self.namespace, key, last)
        blobs = []
        for h in hashes[first:]:
            blob = self.storage.get(h) if self.storage.exists(h) else None
            if blob is None:
                break
            blobs.append(blob)
        end = (first + len(blobs)) * PAGE_TOKENS
        if end <= have:
            return have
        m = self.host_cache.match_prefix(key[:have])
        self.host_cache.inc_lock_ref(m.last_node)
        try:
            new = self._alloc(self.host_alloc, self.host_cache, end - have)
        finally:
            self.host_cache.dec_lock_ref(m.last_node)
        if new is None:
            return have
        pos = have
        for i, blob in enumerate(blobs):
            start = (first + i) * PAGE_TOKENS
            skip = pos - start
            self.host.import_(new[pos - have:start + PAGE_TOKENS - have], blob, skip)
            pos = start + PAGE_TOKENS
        self.host_cache.insert(key[:end], torch.cat((m.slots, new)))
        self.stats.storage_pages_read += len(blobs)
        return end

    # ------------------------------------------------------------------ load-back
    def prepare_admission(self, waiting: list[Req]) -> None:
        """Load back host / storage prefixes of the first waiting requests (module docstring)."""
        live = {r.rid for r in waiting}
        self._loaded = {rid: v for rid, v in self._loaded.items() if rid in live}
        budget = self.max_load_tokens
        locked = []
        try:
            for req in waiting[:MAX_PREPARED_REQS]:
                key = req.cache_key(req.seq_len - 1)
                node, loaded = self._load_back(req, key, budget)
                if node is not None:
                    locked.append(node)
                    budget -= loaded
                if budget <= 0:
                    break
        finally:
            for node in locked:
                self.cache.dec_lock_ref(node)

    def _load_back(self, req: Req, key: list[int], budget: int):
        """Bring ``key``'s lower-tier prefix onto the device; returns (the locked device node
        that now ends it, tokens loaded) or (None, 0) when there was nothing to do or no room."""
        dev = sum(n for _, n in self.cache.walk(key))
        host0 = sum(n for _, n in self.host_cache.walk(key))
        host = host0
        if self.storage is not None and self._storage_has(key, max(dev, host)):
            if dev > host:  # storage pages extend the host path: give it the device part first
                self._backup(key[:dev], self.cache.match_prefix(key[:dev]).slots)
                host0 = host = sum(n for _, n in self.host_cache.walk(key))
            if host >= dev:
                host = self._read_pages(key, host)
        n = host - dev
        if n <= 0 or n > budget or n > self.allocator.available_size() + self.cache.evictable_size():
            return None, 0
        dm = self.cache.match_prefix(key[:dev])
        hm = self.host_cache.match_prefix(key[:host])
        self.cache.inc_lock_ref(dm.last_node)
        self.host_cache.inc_lock_ref(hm.last_node)
        try:
            new = self._alloc(self.allocator, self.cache, n)
            if new is not None:
                self.host.load(self.kv_pool, hm.slots[dev:], new)
        finally:
            self.host_cache.dec_lock_ref(hm.last_node)
            self.cache.dec_lock_ref(dm.last_node)
        if new is None:
            return None, 0
        already = self.cache.insert(key[:host], torch.cat((dm.slots, new)))
        assert already == dev, (already, dev)
        end = self.cache.match_prefix(key[:host]).last_node
        self.cache.inc_lock_ref(end)
        from_host = max(0, host0 - dev)
        self._loaded[req.rid] = _Loaded(host, from_host, n - from_host)
        return end, n

    def admit(self, req: Req, match: MatchResult) -> bool:
        ok = super().admit(req, match)
        loaded = self._loaded.pop(req.rid, None)
        if ok and loaded is not None and len(match.slots) >= loaded.end:
            st = self.stats
            st.host_hit_tokens += loaded.host
            st.storage_hit_tokens += loaded.storage
            st.host_hits += loaded.host > 0
            st.storage_hits += loaded.storage > 0
        return ok

    # ------------------------------------------------------------------ lifecycle
    def on_weight_version(self, generation: int, label: int | str | None = None) -> None:
        """Host copies of older weights are dropped with the device tree's; the storage
        namespace carries the generation, so older pages are never read either."""
        super().on_weight_version(generation, label)
        self.host_cache.set_version(generation)

    def flush_cache(self) -> bool:
        """Drop every cached prefix of the device and host tiers (the storage tier stays)."""
        if not super().flush_cache():
            return False
        self.host_cache.reset()
        return True

    def host_account(self) -> tuple[int, int, int]:
        return self.host_alloc.available_size(), self.host_cache.total_size(), self.host.size

    def check_conservation(self, running: list[Req]) -> None:
        super().check_conservation(running)
        free, cached, size = self.host_account()
        if free + cached != size:
            raise AssertionError(f"host KV slots lost: free {free} + cache-held {cached} "
                                 f"!= host pool size {size}")

    def tier_snapshot(self) -> dict:
        """The counters plus the host tier's size, use and bytes per token."""
        free, cached, size = self.host_account()
        return {**asdict(self.stats), "host_pool_tokens": size, "host_cached_tokens": cached,
                "host_bytes_per_token": self.host.bytes_per_token}
