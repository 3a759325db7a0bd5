"""Always-on KV slot accounting, cheap enough for production.

Every ``kv_audit_interval_steps`` scheduler steps :class:`KVAudit` compares free +
request-held + cache-held slots with the pool's size (and, with the hierarchical cache,
free + cached host-tier slots with the host pool's), from counters and the holders'
lengths (no walk of the tree, no tensor work). The signed difference is
:attr:`KVAudit.leak`: 0 while every slot is accounted for, positive when slots went
missing, negative when some are counted twice; it is exported as
``radixray:kv_slot_leak``. When it turns non-zero (or changes) the owner sets are logged
once: the free count, each holder's rid with its owned and reserved slots, and the
cache's evictable, protected and retired sizes. Tests keep the stricter
``check_kv_conservation`` option, which asserts after every step.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class KVAudit:
    def __init__(self, interval_steps: int):
        self.interval_steps = interval_steps
        self.steps = 0
        self.checks = 0
        self.leak = 0

    def after_step(self, scheduler) -> None:
        """Count a step; audit on every ``interval_steps``-th (0: never)."""
        if not self.interval_steps:
            return
        self.steps += 1
        if self.steps % self.interval_steps == 0:
            self.check(scheduler)

    def check(self, scheduler) -> int:
        """Audit now (scheduler thread); returns the leak."""
        holders = scheduler.kv_holders()
        kv = scheduler.kv
        free, held, cached = kv.account(holders)
        leak = kv.pool_size - (free + held + cached)
        host = kv.host_account()  # the hierarchical cache's host tier: free + cached == size
        if host is not None:
            leak += host[2] - host[0] - host[1]
        self.checks += 1
        if leak and leak != self.leak:
            cache = kv.cache
            owners = ", ".join(f"{r.rid}: {r.owned_kv_len} owned + {r.kv_reserved} reserved"
                               for r in holders if r.req_row is not None) or "none"
            logger.error(
                "KV slot accounting is off by %d (pool %d != free %d + request-held %d + "
                "cache-held %d). Requests: %s. Cache: %d evictable, %d protected, %d in "
                "retired trees; host tier (free, cached, size): %s", leak, kv.pool_size, free,
                held, cached, owners, cache.evictable_size(), cache.protected_size(),
                cache.retired_size(), host)
        elif not leak and self.leak:
            logger.warning("KV slot accounting balances again")
        self.leak = leak
        return leak
