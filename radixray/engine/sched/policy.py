"""Order of the waiting queue before admission: fcfs, lpm (longest prefix match), priority."""

from __future__ import annotations

from collections.abc import Callable

from radixray.engine.request import Req

SCHEDULE_POLICIES = ("fcfs", "lpm")
LPM_MAX_QUEUE = 128  # above this many waiting requests, prefix matching costs more than it saves


def active_policy(policy: str, num_waiting: int, cache_disabled: bool) -> str:
    """The policy used this turn: cache-aware ordering falls back to fcfs when it cannot pay off."""
    if policy == "lpm" and (cache_disabled or num_waiting > LPM_MAX_QUEUE):
        return "fcfs"
    return policy


def order_waiting(waiting: list[Req], policy: str, *, cache_disabled: bool,
                  prefix_len: Callable[[Req], int], priority_first: bool) -> list[Req]:
    """Return the waiting requests in admission order.

    fcfs keeps arrival order; lpm puts the longest cached prefix first. With
    priority scheduling, a higher ``priority`` value always goes first and the
    policy orders requests of equal priority.
    """
    policy = active_policy(policy, len(waiting), cache_disabled)
    if policy == "lpm":
        keyed = [(-prefix_len(r), r.arrival_time, r) for r in waiting]
    else:
        keyed = [(0, r.arrival_time, r) for r in waiting]
    if priority_first:
        keyed = [(-r.priority, *k) for k, r in zip(keyed, waiting)]
    keyed.sort(key=lambda k: k[:-1])
    return [k[-1] for k in keyed]


IN_BATCH_PREFIX_CHECK = 32  # a cached match this short leaves room for an in-batch duplicate
IN_BATCH_PREFIX_DEFER = 32  # sharing this many leading tokens with a batch member defers a request


class InBatchPrefixes:
    """Defer requests that would recompute a prefix another request in this batch computes now.

    Requests sent together that share a long uncached prefix (a system prompt
    nobody has used yet) would each compute it in the same prefill batch. The
    radix cache only sees the prefix after that batch, so a request whose cached
    match is at most ``IN_BATCH_PREFIX_CHECK`` tokens and whose first
    ``IN_BATCH_PREFIX_DEFER`` tokens equal those of a request already in the batch
    (or of the request being chunk-prefilled) waits one round, then hits the
    cache. A request is only ever deferred in favour of one that is running, so
    the queue always makes progress.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._heads: set[tuple[int, ...]] = set()

    @staticmethod
    def _head(req: Req) -> tuple[int, ...] | None:
        # Slice the prompt rather than ``all_ids`` (which copies the whole sequence); a
        # retracted request's short prompt continues into its output.
        # The adapter's namespace leads: requests of different adapters never share KV.
        ids = req.prompt_ids if len(req.prompt_ids) >= IN_BATCH_PREFIX_DEFER else req.all_ids
        if len(ids) < IN_BATCH_PREFIX_DEFER:
            return None
        return (req.lora_ns, *ids[:IN_BATCH_PREFIX_DEFER])

    def add(self, req: Req) -> None:
        """Record a request that computes its prefix in this batch."""
        head = self._head(req) if self.enabled else None
        if head is not None:
            self._heads.add(head)

    def should_defer(self, req: Req, cached_len: int) -> bool:
        if not self.enabled or not self._heads or cached_len > IN_BATCH_PREFIX_CHECK:
            return False
        return self._head(req) in self._heads
