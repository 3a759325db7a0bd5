"""Retraction: when decode outgrows a boldly admitted batch, requests go back to the queue and
still produce exactly the tokens they would have produced alone; a request that cannot fit even
alone is aborted with an out-of-memory reason instead of looping."""

from __future__ import annotations

import logging
import random
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import pytest

from radixray import Engine

PROMPT_LEN = 40
MAX_NEW = 120
RETRACT_LOG = "KV cache pool is full. Retract requests."


@pytest.fixture(scope="module")
def long_runners(tiny_llama_dir):
    """Prompts whose greedy output (EOS allowed) runs the full MAX_NEW tokens, with those tokens,
    from a pool big enough that nothing is ever retracted."""
    rng = random.Random(0)
    greedy = {"max_new_tokens": MAX_NEW, "temperature": 0.0}
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=8192,
                check_kv_conservation=True) as eng:
        vocab = eng.limits.vocab_size
        candidates = [[rng.randrange(1, vocab) for _ in range(PROMPT_LEN)] for _ in range(12)]
        # Alone, one at a time: the reference has no batching or caching effects.
        refs = [eng.generate(input_ids=p, sampling_params=greedy) for p in candidates]
        assert eng.scheduler.stats.num_retracted_reqs == 0
        eng.check_kv_conservation()
    picked = [(p, r["output_ids"]) for p, r in zip(candidates, refs)
              if len(r["output_ids"]) == MAX_NEW]
    assert len(picked) >= 4, "the tiny model stops early too often for this test"
    return picked[:4]


def test_retraction_frees_kv_and_outputs_match_alone(tiny_llama_dir, long_runners, caplog):
    prompts = [p for p, _ in long_runners]
    # 300 slots: admission at conservativeness 0.3 lets three requests in, but three full
    # requests need 3 x 160 = 480 slots, so decode must retract.
    with caplog.at_level(logging.WARNING, logger="radixray.scheduler"), \
            Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=300,
                   schedule_conservativeness=0.3, check_kv_conservation=True) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": MAX_NEW, "temperature": 0.0, "stop_token_ids": []})
        stats = eng.scheduler.stats
        assert stats.num_retracted_reqs > 0
        assert eng.scheduler.max_running_seen >= 2
        state = eng.check_kv_conservation()
        assert state["running"] == state["waiting"] == 0
    assert any(RETRACT_LOG in rec.getMessage() for rec in caplog.records)
    retractions = [o["meta_info"]["num_retractions"] for o in outs]
    assert sum(retractions) == stats.num_retracted_reqs
    assert max(retractions) > 0
    for i, (out, (_, ref)) in enumerate(zip(outs, long_runners)):
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW}, i
        assert out["output_ids"] == ref, f"request {i} (retracted {retractions[i]}x) differs"


def test_request_too_big_for_the_pool_is_aborted_not_looped(tiny_llama_dir, caplog):
    rng = random.Random(3)
    with caplog.at_level(logging.WARNING, logger="radixray.scheduler"), \
            Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=64,
                   check_kv_conservation=True) as eng:
        vocab = eng.limits.vocab_size
        prompt = [rng.randrange(1, vocab) for _ in range(40)]
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(eng.generate, input_ids=prompt, rid="too-big", sampling_params={
                "max_new_tokens": 100, "ignore_eos": True, "temperature": 0.0})
            try:
                out = future.result(timeout=60)
            except FutureTimeout:
                eng.abort("too-big")
                pytest.fail("a request that cannot fit even alone never finished (retract loop?)")
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort"
        assert "out of memory" in reason["message"].lower()
        # It ran until the pool was full: 64 slots hold the prompt and 24 decoded tokens.
        assert len(out["output_ids"]) == 64 - 40 + 1
        assert eng.scheduler.stats.num_aborted_reqs == 1
        eng.check_kv_conservation()
        # The engine keeps serving: a request that fits runs to completion.
        small = [rng.randrange(1, vocab) for _ in range(10)]
        ok = eng.generate(input_ids=small, sampling_params={
            "max_new_tokens": 20, "ignore_eos": True, "temperature": 0.0})
        assert ok["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
        state = eng.check_kv_conservation()
        assert state["running"] == state["waiting"] == 0
    assert any(RETRACT_LOG in rec.getMessage() for rec in caplog.records)
