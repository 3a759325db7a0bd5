"""Ownership of KV slots between requests and the radix cache.

Every slot is in exactly one of three places: the allocator's free list, a
request (slots past its locked prefix), or the radix tree. ``check_conservation``
asserts ``free + request-held + cache-held == pool size``.

Weight versions: a request's KV is shared through the prefix cache only under the
weights it was admitted under (``Req.kv_version``, the cache's generation then: an int
that every weight change advances, whatever the user-facing version label is). After
:meth:`KVManager.on_weight_version` a request admitted earlier (one paused in place
across the update) goes on using its own KV but never inserts it into the cache;
when it ends its KV is freed. New requests, retracted ones included, match and
prefill under the new weights only.
"""

from __future__ import annotations

import torch

from radixray.engine.mem_cache.pool import ReqToTokenPool, TokenSlotAllocator
from radixray.engine.mem_cache.radix_cache import MatchResult, RadixCache
from radixray.engine.request import Req


class KVManager:
    """Allocates, shares, caches and frees the KV of requests.

    A request shares its KV through ``cache`` only while ``req.kv_version`` equals
    ``cache.version`` (see the module docstring). Scheduler thread only.
    """

    def __init__(self, allocator: TokenSlotAllocator, req_pool: ReqToTokenPool, cache: RadixCache):
        self.allocator = allocator
        self.req_pool = req_pool
        self.cache = cache
        self.table = req_pool.table
        # the user-facing weight version new requests' weight_spans start with
        self.weight_label: int | str = cache.version

    @property
    def pool_size(self) -> int:
        return self.allocator.size

    def available_tokens(self) -> int:
        """Slots a new allocation can get: free now plus evictable cached prefixes."""
        return self.allocator.available_size() + self.cache.evictable_size()

    def prepare_admission(self, waiting: list[Req]) -> None:
        """Before a prefill batch is built: make cached prefixes of ``waiting`` requests that
        live outside the device pool matchable (the hierarchical cache loads them back).
        Never frees a locked slot. Nothing to do with a device-only cache."""

    def match(self, req: Req) -> MatchResult:
        """Cached prefix of the request's sequence, at most ``req.prefix_limit`` tokens
        (``seq_len - 1``, less while prompt logprobs are pending). Locks nothing."""
        return self.cache.match_prefix(req.cache_key(req.prefix_limit))

    def alloc_slots(self, n: int) -> torch.Tensor | None:
        """``n`` free slots, evicting unlocked cached prefixes if needed; ``None`` if impossible."""
        slots = self.allocator.alloc(n)
        if slots is None:
            self.cache.evict(n - self.allocator.available_size())
            slots = self.allocator.alloc(n)
        return slots

    def lock_cost(self, match: MatchResult) -> int:
        """Evictable cached tokens that locking ``match`` would take out of ``available_tokens``."""
        cost, node = 0, match.last_node
        while node.parent is not None:
            if node.lock_ref == 0:
                cost += len(node)
            node = node.parent
        return cost

    def admit(self, req: Req, match: MatchResult) -> bool:
        """Give the request a table row and lock its matched prefix. False if no row is free."""
        row = self.req_pool.alloc()
        if row is None:
            return False
        req.req_row = row
        n = len(match.slots)
        if n:
            self.table[row, :n] = match.slots
        self.cache.inc_lock_ref(match.last_node)
        req.last_node = match.last_node
        req.kv_len = req.cache_locked_len = n
        req.kv_version = self.cache.version
        if not req.weight_spans:  # its first token will come from the weights serving now
            req.weight_spans.append([self.weight_label, 0])
        return True

    def extend(self, req: Req, n: int) -> torch.Tensor | None:
        """Allocate KV for the request's next ``n`` tokens and record them in its row
        (reserved until :meth:`Req.commit_kv`)."""
        slots = self.alloc_slots(n)
        if slots is not None:
            self.table[req.req_row, req.kv_len:req.kv_len + n] = slots
            req.kv_reserved = n
        return slots

    def extend_decode(self, reqs: list[Req]) -> torch.Tensor | None:
        """One slot per request for a decode step, written at each request's current length
        (reserved until :meth:`Req.commit_kv`)."""
        slots = self.alloc_slots(len(reqs))
        if slots is not None:
            rows = torch.tensor([r.req_row for r in reqs], dtype=torch.int64)
            cols = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
            self.table[rows, cols] = slots
            for r in reqs:
                r.kv_reserved = 1
        return slots

    def _insert(self, req: Req) -> None:
        """Move the request's computed KV into the tree; free its duplicate slots."""
        key = req.cache_key(req.kv_len)
        row_slots = self.table[req.req_row, : req.kv_len]
        already = self.cache.insert(key, row_slots)
        if already > req.cache_locked_len:
            self.allocator.free(row_slots[req.cache_locked_len:already].clone())

    def _shares_cache(self, req: Req) -> bool:
        """Whether the request's KV may go into the cache: enabled, and same weight version."""
        return not self.cache.disabled and req.kv_version == self.cache.version

    def cache_unfinished(self, req: Req) -> None:
        """After a prefill chunk: share the request's KV through the tree and keep it locked.
        A request of an older weight version keeps its KV to itself."""
        if not self._shares_cache(req):
            return
        self._insert(req)
        match = self.cache.match_prefix(req.cache_key(req.kv_len))
        n = len(match.slots)
        self.table[req.req_row, :n] = match.slots
        self.cache.inc_lock_ref(match.last_node)
        self.cache.dec_lock_ref(req.last_node)
        req.last_node = match.last_node
        req.cache_locked_len = n

    def release(self, req: Req) -> None:
        """The request stops holding KV (finished, aborted, retracted or failed).

        Its computed KV goes into the tree (so a retried or repeated prompt hits),
        or back to the free list when the cache is disabled or the request's KV is of
        an older weight version. Slots reserved for a step that never completed go
        back to the free list.
        """
        if req.req_row is None:
            return
        if req.kv_reserved:
            self.allocator.free(
                self.table[req.req_row, req.kv_len:req.kv_len + req.kv_reserved].clone())
            req.kv_reserved = 0
        if self._shares_cache(req):
            self._insert(req)
        else:
            # cache_locked_len is 0 when the cache is disabled; with an older version,
            # the retired tree frees the locked prefix once its last user lets go.
            self.allocator.free(self.table[req.req_row, req.cache_locked_len:req.kv_len].clone())
        self.cache.dec_lock_ref(req.last_node)
        self.req_pool.free(req.req_row)
        req.req_row = None
        req.last_node = None
        req.kv_len = req.cache_locked_len = 0

    def on_weight_version(self, generation: int, label: int | str | None = None) -> None:
        """New weights went live: ``generation`` keys the cache from now on (an int never
        used before), ``label`` is their user-facing version (default: ``generation``).
        Cached KV of older generations is never matched again, and requests admitted
        before keep but no longer share their KV. Scheduler thread, between steps."""
        self.cache.set_version(generation)
        self.weight_label = generation if label is None else label

    def rename_weights(self, label: int | str) -> None:
        """The weights serving now are called ``label`` (no new weights: the cache stays)."""
        self.weight_label = label

    def flush_cache(self) -> bool:
        """Drop every cached prefix. Only possible while no request holds a row."""
        if self.req_pool.available_size() != self.req_pool.max_requests:
            return False
        self.cache.reset()
        return True

    def account(self, holders: list[Req]) -> tuple[int, int, int]:
        """(free, request-held, cache-held) slots, from counters and ``holders``' lengths."""
        held = sum(r.owned_kv_len + r.kv_reserved for r in holders if r.req_row is not None)
        return self.allocator.available_size(), held, self.cache.total_size()

    def host_account(self) -> tuple[int, int, int] | None:
        """(free, cache-held, pool size) of a host KV tier, or None without one."""
        return None

    def tier_snapshot(self) -> dict | None:
        """Counters of the tiers below the device pool (metrics), or None without them."""
        return None

    def check_conservation(self, running: list[Req]) -> None:
        """Raise AssertionError unless free + request-held + cache-held == pool size."""
        free, held, cached = self.account(running)
        if free + held + cached != self.pool_size:
            raise AssertionError(
                f"KV slots lost: free {free} + request-held {held} + cache-held {cached} "
                f"!= pool size {self.pool_size}")
