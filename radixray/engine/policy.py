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
