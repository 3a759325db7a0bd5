"""Version-aware prefix cache: after a weight update, KV computed under older weights is never
reused by a request admitted later, while requests paused in place across the update keep
(and finally free) their own KV. Unit tests on RadixCache / KVManager, then in-process engine
tests on the tiny Llama."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import GREEDY, in_thread, rand_ids, wait_until

from radixray import Engine
from radixray.engine.mem_cache.kv_manager import KVManager
from radixray.engine.mem_cache.pool import ReqToTokenPool, TokenSlotAllocator
from radixray.engine.mem_cache.radix_cache import RadixCache
from radixray.engine.request import Req
from radixray.engine.sampling import SamplingParams

POOL = 32


def _conserved(cache: RadixCache, alloc: TokenSlotAllocator, held: torch.Tensor | None = None):
    """free + caller-held + cache-held == pool, and every slot is in exactly one place."""
    held = torch.empty(0, dtype=torch.int64) if held is None else held
    assert alloc.available_size() + held.numel() + cache.total_size() == alloc.size
    everywhere = torch.cat([alloc._free, held, cache.all_slots()]).sort().values
    assert everywhere.tolist() == list(range(1, alloc.size + 1))


def _fill(cache: RadixCache, alloc: TokenSlotAllocator, key: list[int]) -> torch.Tensor:
    """Cache ``key`` with fresh slots (the caller frees the duplicates of a present prefix)."""
    slots = alloc.alloc(len(key))
    already = cache.insert(key, slots)
    alloc.free(slots[:already])
    return slots[already:]


def _locked(cache: RadixCache, key: list[int]):
    node = cache.match_prefix(key).last_node
    cache.inc_lock_ref(node)
    return node


# ------------------------------------------------------------------ RadixCache
def test_new_version_matches_nothing_old_then_caches_again():
    alloc = TokenSlotAllocator(POOL)
    cache = RadixCache(alloc)
    _fill(cache, alloc, [1, 2, 3, 4, 5])
    assert len(cache.match_prefix([1, 2, 3, 4]).slots) == 4
    cache.set_version(1)
    assert cache.version == 1
    m = cache.match_prefix([1, 2, 3, 4])
    assert m.slots.numel() == 0 and m.last_node is cache.root_node
    # Nothing locked it, so the old KV went back to the pool right away.
    assert alloc.available_size() == POOL and cache.total_size() == 0
    _conserved(cache, alloc)
    new = _fill(cache, alloc, [1, 2, 3, 4, 5])
    assert len(new) == 5  # nothing was present: the old copy is gone
    assert cache.match_prefix([1, 2, 3, 4]).slots.tolist() == new[:4].tolist()
    _conserved(cache, alloc)


def test_same_version_is_a_no_op():
    alloc = TokenSlotAllocator(POOL)
    cache = RadixCache(alloc)
    _fill(cache, alloc, [1, 2, 3])
    cache.set_version(0)
    assert len(cache.match_prefix([1, 2, 3]).slots) == 3
    cache.set_version(4)
    _fill(cache, alloc, [1, 2, 3])
    cache.set_version(4)
    assert len(cache.match_prefix([1, 2, 3]).slots) == 3
    _conserved(cache, alloc)


def test_locked_retired_kv_stays_until_unlocked_then_the_tree_goes():
    alloc = TokenSlotAllocator(POOL)
    cache = RadixCache(alloc)
    s = _fill(cache, alloc, [1, 2, 3, 4, 5, 6])
    node = _locked(cache, [1, 2, 3])  # a request paused in place reads these three
    cache.set_version(1)
    # The unlocked tail [4, 5, 6] is freed now; the locked prefix stays, protected.
    assert cache.protected_size() == 3 and cache.evictable_size() == 0
    assert cache.retired_size() == 3 and "retired root" in cache.pretty_print()
    assert sorted(cache.all_slots().tolist()) == sorted(s[:3].tolist())
    _conserved(cache, alloc)
    # Neither matching nor memory pressure touches it.
    assert cache.match_prefix([1, 2, 3]).slots.numel() == 0
    assert cache.evict(POOL) == 0
    assert cache.retired_size() == 3
    cache.dec_lock_ref(node)
    assert cache.total_size() == cache.retired_size() == 0
    assert cache._retired == []
    assert alloc.available_size() == POOL
    _conserved(cache, alloc)
    alloc.debug_check()


def test_unlocked_retired_kv_goes_before_current_kv_even_a_less_used_one():
    alloc = TokenSlotAllocator(POOL)
    cache = RadixCache(alloc, eviction_policy="lfu")
    old = _fill(cache, alloc, [1, 2, 3])
    for _ in range(5):
        cache.match_prefix([1, 2, 3])  # many hits: lfu alone would keep it longest
    node = _locked(cache, [1, 2, 3])
    cache.set_version(1)
    current = _fill(cache, alloc, [7, 8, 9])  # no hits at all
    cache.dec_lock_ref(node)
    # The retired copy left the moment its last user let go; the current one stays.
    assert set(alloc._free[-3:].tolist()) == set(old.tolist())
    assert sorted(cache.all_slots().tolist()) == sorted(current.tolist())
    assert cache.evictable_size() == 3
    _conserved(cache, alloc)


def test_nested_and_branching_locks_in_a_retired_tree():
    alloc = TokenSlotAllocator(POOL)
    cache = RadixCache(alloc)
    _fill(cache, alloc, [1, 2, 3, 4])
    _fill(cache, alloc, [1, 2, 9, 9])  # splits: [1, 2] -> [3, 4] | [9, 9]
    short = _locked(cache, [1, 2])
    deep = _locked(cache, [1, 2, 3, 4])
    other = _locked(cache, [1, 2, 9, 9])
    cache.set_version(1)
    assert cache.retired_size() == 6
    cache.dec_lock_ref(short)  # [1, 2] is still locked through both branches
    assert cache.retired_size() == 6
    cache.dec_lock_ref(deep)  # frees [3, 4] only
    assert cache.retired_size() == 4 and cache.protected_size() == 4
    _conserved(cache, alloc)
    cache.dec_lock_ref(other)  # frees [9, 9] and then [1, 2]
    assert cache.retired_size() == cache.total_size() == 0 and cache._retired == []
    _conserved(cache, alloc)
    with pytest.raises(AssertionError):
        cache.dec_lock_ref(other)


def test_trees_of_several_old_versions_free_independently():
    alloc = TokenSlotAllocator(POOL)
    cache = RadixCache(alloc)
    _fill(cache, alloc, [1, 2, 3])
    v0 = _locked(cache, [1, 2, 3])
    cache.set_version(1)
    _fill(cache, alloc, [1, 2, 3, 4])
    v1 = _locked(cache, [1, 2, 3, 4])
    cache.set_version(2)
    _fill(cache, alloc, [5, 6])
    assert len(cache._retired) == 2 and cache.retired_size() == 7
    assert cache.match_prefix([1, 2, 3, 4]).slots.numel() == 0
    _conserved(cache, alloc)
    cache.dec_lock_ref(v1)
    assert len(cache._retired) == 1 and cache.retired_size() == 3
    cache.dec_lock_ref(v0)
    assert cache._retired == [] and cache.total_size() == 2
    _conserved(cache, alloc)


def test_an_empty_tree_is_not_kept_and_a_root_lock_unlocks():
    alloc = TokenSlotAllocator(POOL)
    cache = RadixCache(alloc)
    root = cache.match_prefix([1, 2]).last_node  # no hit: a request locks the root
    cache.inc_lock_ref(root)
    cache.set_version(1)
    assert cache._retired == [] and root is not cache.root_node
    cache.dec_lock_ref(root)
    assert cache.total_size() == 0
    _conserved(cache, alloc)


def test_reset_frees_every_tree_and_keeps_the_version():
    alloc = TokenSlotAllocator(POOL)
    cache = RadixCache(alloc)
    _fill(cache, alloc, [1, 2, 3])
    node = _locked(cache, [1, 2, 3])
    cache.set_version(1)
    _fill(cache, alloc, [4, 5, 6])
    with pytest.raises(AssertionError):
        cache.reset()  # a request still reads the retired KV
    cache.dec_lock_ref(node)
    cache.reset()
    assert alloc.available_size() == POOL and cache.total_size() == 0
    assert cache._retired == [] and cache.version == 1
    alloc.debug_check()


def test_simulated_cache_follows_versions():
    cache = RadixCache.create_simulated()
    cache.insert([1, 2, 3, 4], torch.tensor([11, 12, 13, 14]))
    node = _locked(cache, [1, 2])
    cache.set_version(1)
    assert cache.match_prefix([1, 2, 3]).slots.numel() == 0
    assert cache.total_size() == cache.retired_size() == 2
    cache.insert([1, 2, 3], torch.tensor([21, 22, 23]))
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == [21, 22, 23]
    cache.dec_lock_ref(node)
    assert cache.total_size() == 3 and cache._retired == []


def test_disabled_cache_only_records_the_version():
    cache = RadixCache(TokenSlotAllocator(8), disable=True)
    root = cache.root_node
    cache.set_version(3)
    assert cache.version == 3 and cache.root_node is root


# ------------------------------------------------------------------ KVManager
def _kv(disable: bool = False) -> KVManager:
    alloc = TokenSlotAllocator(POOL)
    return KVManager(alloc, ReqToTokenPool(4, 64), RadixCache(alloc, disable=disable))


def _prefill(kv: KVManager, rid: str, prompt: list[int]) -> Req:
    """Admit a request with its cached match and run its whole prompt as one chunk."""
    req = Req(rid, prompt, SamplingParams())
    assert kv.admit(req, kv.match(req))
    n = req.seq_len - req.kv_len
    assert kv.extend(req, n) is not None
    req.commit_kv(n)
    return req


def _check(kv: KVManager, *running: Req) -> None:
    kv.check_conservation(list(running))
    kv.allocator.debug_check()


def test_kv_manager_keeps_old_version_kv_out_of_the_new_cache():
    kv = _kv()
    a = _prefill(kv, "a", [1, 2, 3, 4, 5])
    assert a.kv_version == 0
    kv.cache_unfinished(a)  # shared under version 0
    assert a.cache_locked_len == 5
    kv.on_weight_version(1)
    assert kv.cache.retired_size() == 5
    a.output_ids.append(6)
    assert kv.extend_decode([a]) is not None
    a.commit_kv(1)
    kv.cache_unfinished(a)  # old version: keeps its KV to itself
    assert a.cache_locked_len == 5 and a.owned_kv_len == 1
    _check(kv, a)
    b = _prefill(kv, "b", [1, 2, 3, 4, 5, 6, 7])
    assert b.kv_version == 1 and b.cache_locked_len == 0  # nothing of version 0 matched
    kv.cache_unfinished(b)
    _check(kv, a, b)
    kv.release(a)  # frees its own slot and, by unlocking, the retired prefix
    assert kv.cache.retired_size() == 0 and kv.cache._retired == []
    _check(kv, b)
    kv.release(b)
    assert len(kv.match(Req("c", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams())).slots) == 7
    _check(kv)
    assert kv.flush_cache() and kv.allocator.available_size() == POOL


def test_kv_manager_old_version_reserved_slots_are_freed_too():
    kv = _kv()
    a = _prefill(kv, "a", [1, 2, 3])
    kv.cache_unfinished(a)
    kv.on_weight_version(1)
    a.output_ids.append(4)
    assert kv.extend_decode([a]) is not None  # a step that never completes
    kv.release(a)
    assert kv.allocator.available_size() == POOL and kv.cache.total_size() == 0


def test_kv_manager_with_the_cache_off_ignores_versions():
    kv = _kv(disable=True)
    a = _prefill(kv, "a", [1, 2, 3])
    kv.on_weight_version(1)
    kv.cache_unfinished(a)
    _check(kv, a)
    kv.release(a)
    assert kv.allocator.available_size() == POOL


# ------------------------------------------------------------------ engine
PARAMS = {"max_new_tokens": 40, **GREEDY}


@pytest.fixture(scope="module")
def engine(eng):
    """conftest's tiny-Llama engine (KV conservation checked after every step)."""
    return eng


def _bump(engine: Engine) -> int:
    """A weight update goes live between two steps (what the weight-update path will call)."""
    def bump(s) -> int:
        s.kv.on_weight_version(s.kv.cache.version + 1)
        return s.kv.cache.version
    return engine.call_in_loop(bump)


def _cached(engine: Engine, prompt: list[int], params=None) -> int:
    return engine.generate(input_ids=prompt, sampling_params=params or
                           {"max_new_tokens": 3, **GREEDY})["meta_info"]["cached_tokens"]


def _retired(engine: Engine) -> int:
    return engine.call_in_loop(lambda s: s.kv.cache.retired_size())


def _decoding(rid: str):
    return lambda s: any(r.rid == rid and r.output_ids for r in s.queues.running)


def test_a_version_bump_hides_old_prefixes_from_new_requests(engine):
    prompt = rand_ids(engine.limits.vocab_size, 50, seed=101)
    assert _cached(engine, prompt) == 0
    assert _cached(engine, prompt) == 49
    _bump(engine)
    assert _cached(engine, prompt) == 0
    assert _cached(engine, prompt) == 49
    state = engine.check_kv_conservation()
    assert state["running"] == 0 and _retired(engine) == 0


def test_an_in_place_request_lives_through_the_bump_and_its_kv_is_not_shared(engine):
    prompt = rand_ids(engine.limits.vocab_size, 50, seed=102)
    want = engine.generate(input_ids=prompt, sampling_params=PARAMS)["output_ids"]
    t, box = in_thread(engine.generate, input_ids=prompt, rid="inplace", sampling_params=PARAMS)
    wait_until(engine, _decoding("inplace"))
    assert engine.pause_generation("in_place") == 1
    _bump(engine)
    # Its prompt, cached under the old weights, is now held only for it.
    assert _retired(engine) == len(prompt)
    engine.check_kv_conservation()
    engine.continue_generation()
    t.join(60)
    assert box["out"]["output_ids"] == want  # same weights in this simulation
    assert box["out"]["meta_info"]["finish_reason"]["type"] == "length"
    state = engine.check_kv_conservation()
    assert state["running"] == 0 and _retired(engine) == 0
    # Neither the old cache entry nor the in-place request's KV is matched.
    assert _cached(engine, prompt) == 0
    assert _cached(engine, prompt) == 49


@pytest.mark.parametrize("order", ["retract_then_bump", "bump_then_retract"])
def test_a_retracted_request_prefills_again_under_the_new_version(engine, order):
    prompt = rand_ids(engine.limits.vocab_size, 50, seed=103)
    want = engine.generate(input_ids=prompt, sampling_params=PARAMS)["output_ids"]
    t, box = in_thread(engine.generate, input_ids=prompt, rid="retracted", sampling_params=PARAMS)
    wait_until(engine, _decoding("retracted"))
    if order == "retract_then_bump":
        engine.pause_generation("retract")
        _bump(engine)
    else:
        engine.pause_generation("in_place")
        _bump(engine)
        engine.pause_generation("retract")  # releases KV of the old version
    seq_len, before = engine.call_in_loop(
        lambda s: (s.queues.waiting[0].seq_len, s.stats.prefill_input_tokens))
    state = engine.check_kv_conservation()
    assert state["free"] + state["cached"] == state["pool"] and _retired(engine) == 0
    engine.continue_generation()
    t.join(60)
    assert box["out"]["output_ids"] == want
    assert box["out"]["meta_info"]["num_retractions"] == 1
    # Nothing of the old version was reused: the whole sequence so far ran again.
    assert engine.call_in_loop(lambda s: s.stats.prefill_input_tokens) - before == seq_len
    engine.check_kv_conservation()


def test_a_chunked_prefill_paused_across_the_bump_finishes_and_frees_its_kv(tiny_llama_dir):
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096,
                chunked_prefill_size=16, check_kv_conservation=True) as eng:
        # 900 tokens in chunks of 16: ~56 prefill steps, so the poll (every 5 ms) sees the
        # request mid-prefill however fast the host runs a chunk
        prompt = rand_ids(eng.limits.vocab_size, 900, seed=104)
        params = {"max_new_tokens": 5, **GREEDY}
        want = eng.generate(input_ids=prompt, sampling_params=params)["output_ids"]
        assert eng.flush_cache()
        t, box = in_thread(eng.generate, input_ids=prompt, rid="chunky", sampling_params=params)

        def pause_mid_prefill(s) -> bool:
            req = s.queues.chunked
            if req is not None and req.rid == "chunky" and req.kv_len >= 48:
                return s.pause("in_place") == 1
            return False
        wait_until(eng, pause_mid_prefill)
        held = eng.call_in_loop(lambda s: s.queues.chunked.cache_locked_len)
        assert 48 <= held < 900
        _bump(eng)
        assert _retired(eng) == held
        eng.continue_generation()
        t.join(60)
        assert box["out"]["output_ids"] == want
        state = eng.check_kv_conservation()
        assert state["running"] == 0 and _retired(eng) == 0
        # Only what the finished request left (nothing) and no old prefix is cached.
        assert state["cached"] == 0 and state["free"] == state["pool"]
        assert _cached(eng, prompt, params) == 0
        assert _cached(eng, prompt, params) == 899
