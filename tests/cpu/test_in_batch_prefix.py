"""In-batch prefix deferral: requests sent together that share an uncached prefix compute it once.

Without it, every request of a group admitted in the same prefill batch recomputes
the group's shared system prompt, because the radix cache only learns the prefix
after that batch has run.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

from radixray import Engine
from radixray.engine.sched.policy import (
    IN_BATCH_PREFIX_CHECK,
    IN_BATCH_PREFIX_DEFER,
    InBatchPrefixes,
)


def R(ids: list[int]) -> SimpleNamespace:
    """The fields of a Req that the check reads (a fresh request: no output yet)."""
    return SimpleNamespace(prompt_ids=ids, all_ids=ids, lora_ns=0)


def test_defers_only_short_matches_sharing_a_batch_members_head():
    head = list(range(IN_BATCH_PREFIX_DEFER))
    batch = InBatchPrefixes(enabled=True)
    assert not batch.should_defer(R(head + [1, 2]), cached_len=0)  # nothing in the batch yet
    batch.add(R(head + [7, 8, 9]))
    assert batch.should_defer(R(head + [1, 2]), cached_len=0)
    assert batch.should_defer(R(head + [1, 2]), cached_len=IN_BATCH_PREFIX_CHECK)
    # A long cached match means the prefix is already shared: admit.
    assert not batch.should_defer(R(head + [1, 2]), cached_len=IN_BATCH_PREFIX_CHECK + 1)
    # Differs within the first IN_BATCH_PREFIX_DEFER tokens: admit.
    assert not batch.should_defer(R([999] + head[1:] + [1]), cached_len=0)
    # Too short to share a deferrable prefix.
    short = head[: IN_BATCH_PREFIX_DEFER - 1]
    batch.add(R(short))
    assert not batch.should_defer(R(short), cached_len=0)


def test_disabled_never_defers():
    head = list(range(IN_BATCH_PREFIX_DEFER))
    batch = InBatchPrefixes(enabled=False)
    batch.add(R(head))
    assert not batch.should_defer(R(head), cached_len=0)


def _group_prompts(vocab: int, groups: int, per_group: int, prefix_len: int, seed: int = 3):
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        prefix = [rng.randrange(1, vocab) for _ in range(prefix_len)]
        prompts += [prefix + [rng.randrange(1, vocab) for _ in range(12)] for _ in range(per_group)]
    return prompts


def test_group_sent_together_computes_its_prefix_once(tiny_llama_dir):
    greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096,
                check_kv_conservation=True) as eng:
        prompts = _group_prompts(eng.limits.vocab_size, groups=2, per_group=4, prefix_len=100)
        outs = eng.generate(input_ids=prompts, sampling_params=greedy)
        cached = [o["meta_info"]["cached_tokens"] for o in outs]
        # The first request of each group computes the prefix; the other three are deferred
        # one round and then find it in the tree (prompts of running requests are shared).
        assert cached == [0, 100, 100, 100] * 2
        eng.check_kv_conservation()
        eng.flush_cache()
        alone = [eng.generate(input_ids=p, sampling_params=greedy)["output_ids"] for p in prompts]
    assert [o["output_ids"] for o in outs] == alone


def test_without_radix_cache_the_group_is_batched_together(tiny_llama_dir):
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096,
                disable_radix_cache=True, check_kv_conservation=True) as eng:
        prompts = _group_prompts(eng.limits.vocab_size, groups=1, per_group=4, prefix_len=100)
        outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 2})
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [0] * 4
        assert eng.scheduler.stats.forward_steps == 2  # one prefill for all four, one decode
        eng.check_kv_conservation()
