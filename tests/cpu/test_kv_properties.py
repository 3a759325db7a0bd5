"""Property tests for the KV manager and the radix cache (hypothesis' stateful testing):
random sequences of admit (match + lock), prefill chunks, decode steps, cache inserts,
finishes, aborts mid-step, retractions, evictions, weight-version changes and flushes keep

- conservation: free + request-held + cache-held == pool size, after every step;
- the allocator's own bookkeeping (no slot free twice, none lost);
- the tree's structure: children keyed by their first token, no empty edge below the
  root, a node's slot count equal to its key's length, lock counts never negative and
  equal on a path to the locks the live requests hold;
- matching: a request's matched prefix is always a prefix of its tokens.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixray.engine.mem_cache.kv_manager import KVManager
from radixray.engine.mem_cache.pool import ReqToTokenPool, TokenSlotAllocator
from radixray.engine.mem_cache.radix_cache import RadixCache
from radixray.engine.request import Req
from radixray.engine.sampling import SamplingParams

POOL, ROWS, CONTEXT = 96, 6, 64
# few distinct tokens: prompts share prefixes often, so splits and hits are common
TOKENS = st.lists(st.integers(0, 3), min_size=2, max_size=24)


class KVMachine(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.allocator = TokenSlotAllocator(POOL)
        self.kv = KVManager(self.allocator, ReqToTokenPool(ROWS, CONTEXT),
                            RadixCache(self.allocator))
        self.live: list[Req] = []
        self.count = 0

    # ---- requests -------------------------------------------------------------------
    @precondition(lambda self: len(self.live) < ROWS)
    @rule(prompt=TOKENS)
    def admit(self, prompt):
        self.count += 1
        req = Req(f"r{self.count}", list(prompt), SamplingParams())
        match = self.kv.match(req)
        assert len(match.slots) <= req.seq_len - 1
        path, node = [], match.last_node  # the matched node's path spells the prefix
        while node.parent is not None:
            path[:0] = node.key
            node = node.parent
        assert path == req.all_ids[:len(match.slots)]
        if self.kv.available_tokens() - self.kv.lock_cost(match) < req.seq_len:
            return  # admission would refuse it: the budget has no room
        assert self.kv.admit(req, match)
        self.live.append(req)

    def _pick(self, data):
        return data.draw(st.sampled_from(self.live))

    @precondition(lambda self: any(r.kv_len < r.seq_len and not r.kv_reserved
                                   for r in self.live))
    @rule(data=st.data(), chunk=st.integers(1, 16), complete=st.booleans())
    def prefill_chunk(self, data, chunk, complete):
        req = data.draw(st.sampled_from([r for r in self.live
                                         if r.kv_len < r.seq_len and not r.kv_reserved]))
        n = min(chunk, req.seq_len - req.kv_len)
        if self.kv.extend(req, n) is None:
            return
        if complete:  # else the step is still in flight (an abort may come before it ends)
            req.commit_kv(n)
            self.kv.cache_unfinished(req)

    @precondition(lambda self: any(r.kv_len == r.seq_len and not r.kv_reserved
                                   and r.seq_len < CONTEXT for r in self.live))
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode_step(self, data, token):
        ready = [r for r in self.live if r.kv_len == r.seq_len and not r.kv_reserved
                 and r.seq_len < CONTEXT]
        batch = data.draw(st.lists(st.sampled_from(ready), min_size=1, unique=True))
        for r in batch:
            r.output_ids.append(token)
        if self.kv.extend_decode(batch) is None:
            for r in batch:
                r.output_ids.pop()
            return
        for r in batch:
            r.commit_kv(1)

    @precondition(lambda self: any(r.kv_reserved for r in self.live))
    @rule(data=st.data())
    def step_completes(self, data):
        req = data.draw(st.sampled_from([r for r in self.live if r.kv_reserved]))
        req.commit_kv(req.kv_reserved)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def finish_or_abort(self, data):
        """Finished, aborted, failed mid-step or retracted: the request lets go of its KV."""
        req = self._pick(data)
        self.kv.release(req)
        self.live.remove(req)

    # ---- the cache ------------------------------------------------------------------
    @rule(tokens=st.integers(1, POOL))
    def evict(self, tokens):
        before, free = self.kv.cache.evictable_size(), self.allocator.available_size()
        freed = self.kv.cache.evict(tokens)
        assert 0 <= freed <= before and self.kv.cache.evictable_size() == before - freed
        assert self.allocator.available_size() == free + freed

    @rule()
    def new_weight_version(self):
        self.kv.on_weight_version(self.kv.cache.version + 1)

    @rule()
    def flush(self):
        flushed = self.kv.flush_cache()
        assert flushed == (not self.live)

    # ---- what must always hold ------------------------------------------------------
    @invariant()
    def slots_are_conserved(self):
        if hasattr(self, "kv"):
            self.kv.check_conservation(self.live)
            self.allocator.debug_check()

    @invariant()
    def the_tree_is_well_formed(self):
        if not hasattr(self, "kv"):
            return
        cache = self.kv.cache
        locks: dict[int, int] = {}
        for req in self.live:
            node = req.last_node
            while node is not None and node.parent is not None:
                locks[id(node)] = locks.get(id(node), 0) + 1
                node = node.parent
        tree_slots, walked = [], 0
        for root in [cache.root_node, *cache._retired]:
            for node in cache._iter_nodes(root):
                assert len(node.key) > 0 and len(node.slots) == len(node.key)
                assert node.parent.children[node.key[0]] is node
                assert node.lock_ref == locks.get(id(node), 0), (node.key, node.lock_ref)
                tree_slots += node.slots.tolist()
                walked += len(node)
        assert walked == cache.total_size()  # the counters agree with a walk of the trees
        owned = [s for r in self.live for s in self.kv.table[
            r.req_row, r.cache_locked_len:r.kv_len + r.kv_reserved].tolist()]
        free = self.allocator._free.tolist()
        every = tree_slots + owned + free  # each slot in exactly one place
        assert len(every) == len(set(every)) == POOL, (len(every), len(set(every)))


TestKVProperties = KVMachine.TestCase
TestKVProperties.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
