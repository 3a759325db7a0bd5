"""Unit tests for the radix prefix cache (no model, CPU only)."""

from __future__ import annotations

import pytest
import torch

from radixray.engine.mem_cache.pool import TokenSlotAllocator
from radixray.engine.mem_cache.radix_cache import RadixCache, _common_prefix_len


def _nodes(cache: RadixCache) -> list:
    out, stack = [], list(cache.root_node.children.values())
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


def _slots(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def _cache_request(cache: RadixCache, alloc: TokenSlotAllocator, tokens: list[int]) -> int:
    """Play one request the way the scheduler would; return the tokens it reused.

    Match (prompt minus last token), lock, alloc KV for the rest, insert the
    whole sequence, free the duplicates the tree already had, unlock.
    """
    m = cache.match_prefix(tokens[:-1])
    cache.inc_lock_ref(m.last_node)
    prefix = len(m.slots)
    new = alloc.alloc(len(tokens) - prefix)
    assert new is not None
    slots = torch.cat([m.slots, new])
    already = cache.insert(tokens, slots)
    # The caller owns [prefix, already): the tree had those tokens already.
    alloc.free(slots[prefix:already])
    cache.dec_lock_ref(m.last_node)
    return prefix


def test_common_prefix_len():
    assert _common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert _common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert _common_prefix_len([], [1]) == 0
    assert _common_prefix_len([5], [6]) == 0


def test_match_splits_edge_at_boundary():
    cache = RadixCache.create_simulated()
    assert cache.insert([1, 2, 3, 4, 5], _slots(11, 12, 13, 14, 15)) == 0
    assert len(_nodes(cache)) == 1

    m = cache.match_prefix([1, 2, 3, 9])
    assert m.slots.tolist() == [11, 12, 13]
    assert len(_nodes(cache)) == 2
    upper = m.last_node
    assert upper.key == [1, 2, 3] and upper.slots.tolist() == [11, 12, 13]
    assert upper.parent is cache.root_node
    (lower,) = upper.children.values()
    assert lower.key == [4, 5] and lower.slots.tolist() == [14, 15]
    assert lower.parent is upper
    # Splitting moves no slots: the full key still matches all of them.
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == [11, 12, 13, 14, 15]
    assert cache.total_size() == 5
    assert sorted(cache.all_slots().tolist()) == [11, 12, 13, 14, 15]


def test_split_of_locked_node_keeps_lock_on_both_parts():
    cache = RadixCache.create_simulated()
    cache.insert([1, 2, 3, 4], _slots(1, 2, 3, 4))
    m = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 4
    cache.match_prefix([1, 2])  # splits the locked node
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    assert all(n.lock_ref == 1 for n in _nodes(cache))
    cache.dec_lock_ref(m.last_node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4


def test_match_without_hit_and_partial_key():
    cache = RadixCache.create_simulated()
    cache.insert([1, 2, 3], _slots(1, 2, 3))
    m = cache.match_prefix([7, 8])
    assert m.slots.numel() == 0 and m.last_node is cache.root_node
    assert cache.match_prefix([]).last_node is cache.root_node


def test_duplicate_insert_returns_present_length_and_stores_nothing():
    cache = RadixCache.create_simulated()
    assert cache.insert([1, 2, 3, 4], _slots(1, 2, 3, 4)) == 0
    assert cache.insert([1, 2, 3, 4], _slots(21, 22, 23, 24)) == 4
    assert cache.total_size() == 4
    assert sorted(cache.all_slots().tolist()) == [1, 2, 3, 4]
    # A prefix of a cached key is fully present too (split, but nothing new).
    assert cache.insert([1, 2], _slots(31, 32)) == 2
    assert cache.total_size() == 4
    # Extending adds only the new tail and keeps the tree's copy of the prefix.
    assert cache.insert([1, 2, 3, 4, 5, 6], _slots(41, 42, 43, 44, 45, 46)) == 4
    assert cache.total_size() == 6
    assert sorted(cache.all_slots().tolist()) == [1, 2, 3, 4, 45, 46]
    # Branching inside an edge.
    assert cache.insert([1, 2, 9], _slots(51, 52, 53)) == 2
    assert cache.match_prefix([1, 2, 9]).slots.tolist() == [1, 2, 53]


def test_insert_copies_caller_slots():
    cache = RadixCache.create_simulated()
    row = _slots(1, 2, 3)
    cache.insert([5, 6, 7], row)
    row.fill_(0)  # the caller reuses its request-table row
    assert cache.match_prefix([5, 6, 7]).slots.tolist() == [1, 2, 3]


def test_insert_length_mismatch_raises():
    cache = RadixCache.create_simulated()
    with pytest.raises(ValueError):
        cache.insert([1, 2], _slots(1))


def test_locked_path_survives_evict_then_becomes_evictable():
    alloc = TokenSlotAllocator(16)
    cache = RadixCache(alloc)
    s = alloc.alloc(6)
    cache.insert([1, 2, 3, 4, 5, 6], s)
    m = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 3

    freed = cache.evict(100)
    assert freed == 3  # only the unlocked tail [4, 5, 6]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == s[:3].tolist()
    assert alloc.available_size() == 16 - 3
    assert cache.evict(100) == 0

    cache.dec_lock_ref(m.last_node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 3
    assert cache.evict(100) == 3
    assert cache.total_size() == 0 and alloc.available_size() == 16
    alloc.debug_check()


def test_dec_lock_ref_below_zero_asserts():
    cache = RadixCache.create_simulated()
    cache.insert([1, 2], _slots(1, 2))
    node = cache.match_prefix([1, 2]).last_node
    with pytest.raises(AssertionError):
        cache.dec_lock_ref(node)


def test_nested_locks_count():
    cache = RadixCache.create_simulated()
    cache.insert([1, 2, 3, 4], _slots(1, 2, 3, 4))
    a = cache.match_prefix([1, 2]).last_node
    b = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(a)
    cache.inc_lock_ref(b)
    assert cache.protected_size() == 4
    cache.dec_lock_ref(b)
    assert cache.protected_size() == 2 and cache.evictable_size() == 2
    cache.dec_lock_ref(a)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4


def _three_branches(policy: str):
    alloc = TokenSlotAllocator(30)
    cache = RadixCache(alloc, eviction_policy=policy)
    branch = {}
    for first in (1, 2, 3):
        s = alloc.alloc(3)
        cache.insert([first, 10, 11], s)
        branch[first] = set(s.tolist())
    return alloc, cache, branch


def _freed_set(alloc: TokenSlotAllocator, before: int) -> set[int]:
    # TokenSlotAllocator.free appends to the end of its free list, so the slots
    # past the old length are exactly the ones this eviction returned.
    return set(alloc._free[before:].tolist())


def test_lru_evicts_least_recently_matched_first():
    alloc, cache, branch = _three_branches("lru")
    # Access order after inserts: 2, then 1, then 3 -> 2 is the oldest.
    cache.match_prefix([2, 10, 11])
    cache.match_prefix([1, 10, 11])
    cache.match_prefix([3, 10, 11])
    before = alloc.available_size()
    assert cache.evict(1) == 3
    assert _freed_set(alloc, before) == branch[2]
    before = alloc.available_size()
    assert cache.evict(1) == 3
    assert _freed_set(alloc, before) == branch[1]
    assert cache.match_prefix([3, 10, 11]).slots.numel() == 3


def test_lfu_evicts_least_hit_first_even_if_more_recent():
    alloc, cache, branch = _three_branches("lfu")
    for _ in range(3):
        cache.match_prefix([1, 10, 11])
    for _ in range(2):
        cache.match_prefix([3, 10, 11])
    cache.match_prefix([2, 10, 11])  # most recent, but fewest hits
    before = alloc.available_size()
    assert cache.evict(1) == 3
    assert _freed_set(alloc, before) == branch[2]
    before = alloc.available_size()
    assert cache.evict(1) == 3
    assert _freed_set(alloc, before) == branch[3]


def test_lru_would_evict_differently_from_lfu():
    # Same access pattern as the lfu test: lru must pick the oldest (branch 1's
    # last hit precedes branch 3's), proving the policy changes the choice.
    alloc, cache, branch = _three_branches("lru")
    for _ in range(3):
        cache.match_prefix([1, 10, 11])
    for _ in range(2):
        cache.match_prefix([3, 10, 11])
    cache.match_prefix([2, 10, 11])
    before = alloc.available_size()
    cache.evict(1)
    assert _freed_set(alloc, before) == branch[1]


def test_evicting_leaf_makes_parent_evictable():
    alloc = TokenSlotAllocator(20)
    cache = RadixCache(alloc)
    s = alloc.alloc(5)
    cache.insert([1, 2, 3, 4, 5], s)
    cache.match_prefix([1, 2, 9])  # split: [1, 2] -> [3, 4, 5]
    assert len(_nodes(cache)) == 2
    # Asking for more than the leaf holds forces the parent (now a leaf) out too.
    assert cache.evict(4) == 5
    assert cache.total_size() == 0 and not cache.root_node.children
    assert alloc.available_size() == 20
    alloc.debug_check()


def test_evict_stops_once_enough_is_freed():
    alloc = TokenSlotAllocator(20)
    cache = RadixCache(alloc)
    for first in (1, 2, 3):
        cache.insert([first, 7], alloc.alloc(2))
    assert cache.evict(3) == 4  # two whole leaves
    assert cache.total_size() == 2


def test_disabled_cache_matches_and_stores_nothing():
    alloc = TokenSlotAllocator(8)
    cache = RadixCache(alloc, disable=True)
    assert cache.disabled
    s = alloc.alloc(3)
    assert cache.insert([1, 2, 3], s) == 0
    assert cache.total_size() == 0 and cache.all_slots().numel() == 0
    m = cache.match_prefix([1, 2, 3])
    assert m.slots.numel() == 0 and m.last_node is cache.root_node
    cache.inc_lock_ref(m.last_node)  # harmless on root
    cache.dec_lock_ref(m.last_node)
    assert cache.evict(10) == 0


def test_conservation_with_real_allocator():
    size = 64
    alloc = TokenSlotAllocator(size)
    cache = RadixCache(alloc)
    system = list(range(100, 120))
    reqs = [
        system + [1, 2, 3],
        system + [1, 2, 4, 5],
        system + [7, 8],
        system[:10] + [9, 9, 9],
        system + [1, 2, 3],
        [50, 51, 52],
    ]
    reused = []
    for i, toks in enumerate(reqs):
        need = len(toks)
        if alloc.available_size() < need:
            cache.evict(need - alloc.available_size())
        reused.append(_cache_request(cache, alloc, toks))
        assert alloc.available_size() + cache.total_size() == size, i
        alloc.debug_check()
        if i == 3:
            cache.evict(5)
            assert alloc.available_size() + cache.total_size() == size
    # evict(5) after request 3 took the oldest leaves [3] and [4, 5], then their
    # parent [1, 2] (now an unlocked leaf, older than [7, 8]): request 4 reuses 20.
    assert reused == [0, 22, 20, 10, 20, 0]
    cache.evict(size)
    assert cache.total_size() == 0 and alloc.available_size() == size
    alloc.debug_check()


def test_reset_returns_all_slots():
    alloc = TokenSlotAllocator(32)
    cache = RadixCache(alloc)
    cache.insert([1, 2, 3, 4], alloc.alloc(4))
    cache.insert([1, 2, 5, 6], torch.cat([_slots(0, 0), alloc.alloc(2)]))
    assert alloc.available_size() == 26
    cache.reset()
    assert alloc.available_size() == 32 and cache.total_size() == 0
    assert not cache.root_node.children
    alloc.debug_check()


def test_reset_while_locked_asserts():
    cache = RadixCache.create_simulated()
    cache.insert([1, 2], _slots(1, 2))
    cache.inc_lock_ref(cache.match_prefix([1, 2]).last_node)
    with pytest.raises(AssertionError):
        cache.reset()


def test_invalid_policy_raises():
    with pytest.raises(ValueError, match="radix_eviction_policy"):
        RadixCache(None, eviction_policy="fifo")


def test_pretty_print_lists_nodes():
    cache = RadixCache.create_simulated()
    cache.insert([1, 2, 3], _slots(1, 2, 3))
    cache.insert([1, 2, 4], _slots(1, 2, 4))
    text = cache.pretty_print()
    assert text.count("\n") == 3  # root + [1, 2] + two leaves
