"""Prefill-decode disaggregation between two in-process engines (no Ray): the decode side's
output equals a unified engine's, the KV moves over Mooncake TCP, failures free every slot."""

from __future__ import annotations

import pytest
from engine_helpers import GREEDY, rand_ids
from pd_helpers import EnginePair

from radixray import Engine
from radixray.engine.disaggregation.messages import PDBootstrap


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    p = EnginePair(tiny_llama_dir, max_total_tokens=4096, chunked_prefill_size=64)
    yield p
    p.close()


@pytest.fixture(scope="module")
def unified(tiny_llama_dir):
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096,
                chunked_prefill_size=64) as e:
        yield e


def test_decode_output_equals_unified(pair, unified):
    vocab = unified.limits.vocab_size
    for seed, n in ((1, 5), (2, 150), (3, 300)):  # one chunk, several chunks
        ids = rand_ids(vocab, n, seed)
        sp = dict(GREEDY, max_new_tokens=12, return_logprob=True, top_logprobs_num=3)
        want = unified.generate(input_ids=ids, sampling_params=sp)
        p_out, d_out = pair.generate(ids, sp)
        assert d_out["output_ids"] == want["output_ids"]
        assert d_out["output_token_logprobs"] == pytest.approx(want["output_token_logprobs"],
                                                               abs=1e-5)
        assert len(d_out["output_top_logprobs"]) == 12
        assert p_out["meta_info"]["finish_reason"]["type"] == "length"
        assert d_out["meta_info"]["prompt_tokens"] == n
    pair.check_kv()


def test_seeded_sampling_continues_the_prefill_generator(pair, unified):
    ids = rand_ids(unified.limits.vocab_size, 40, 7)
    sp = {"temperature": 0.9, "seed": 123, "max_new_tokens": 10, "ignore_eos": True}
    want = unified.generate(input_ids=ids, sampling_params=sp)
    _, got = pair.generate(ids, sp)
    assert got["output_ids"] == want["output_ids"]


def test_prefix_hits_on_both_sides(pair, unified):
    """A second request with the same long prefix: the prefill side reports its radix hit,
    the decode side reserves (and receives) only the positions it does not cache."""
    vocab = unified.limits.vocab_size
    prefix = rand_ids(vocab, 200, 11)
    sent = []
    pair.drop = lambda w, m: sent.append(m) and False
    _, first = pair.generate(prefix + rand_ids(vocab, 5, 12), dict(GREEDY, max_new_tokens=4))
    _, second = pair.generate(prefix + rand_ids(vocab, 5, 13), dict(GREEDY, max_new_tokens=4))
    pair.drop = None
    dests = [m for m in sent if type(m).__name__ == "KVDestination"]
    arrivals = [m for m in sent if type(m).__name__ == "KVArrival"]
    assert dests[0].start == 0 and dests[1].start >= 200
    assert len(dests[1].slots) == 205 - dests[1].start
    assert second["meta_info"]["cached_tokens"] >= 200
    assert arrivals[1].bytes < arrivals[0].bytes / 10
    want = unified.generate(input_ids=prefix + rand_ids(vocab, 5, 13),
                            sampling_params=dict(GREEDY, max_new_tokens=4))
    assert second["output_ids"] == want["output_ids"]
    pair.check_kv()


def test_direct_request_is_refused(pair):
    with pytest.raises(ValueError, match="send them to the serving endpoint"):
        pair.d.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
    with pytest.raises(ValueError, match="bootstrap_room must be an integer"):
        PDBootstrap(2**63, "p0")


def test_lost_transfer_times_out_and_frees_slots(tiny_llama_dir):
    """The prefill side's answer never arrives: the decode side fails the request after the
    waiting timeout, quarantines its slots one more timeout, then frees them."""
    pair = EnginePair(tiny_llama_dir, max_total_tokens=1024,
                      disaggregation_waiting_timeout_s=0.5)
    try:
        pair.drop = lambda w, m: w == "d0"  # nothing reaches the decode worker
        p_out, d_out = pair.generate(rand_ids(200, 30, 5), dict(GREEDY, max_new_tokens=4))
        assert d_out["meta_info"]["finish_reason"]["type"] == "error"
        assert "disaggregation_waiting_timeout_s" in d_out["meta_info"]["finish_reason"]["message"]
        assert p_out["meta_info"]["finish_reason"]["type"] in ("length", "abort")
        import time
        deadline = time.monotonic() + 10
        while pair.d.call_in_loop(lambda s: len(s.pd.rooms)) and time.monotonic() < deadline:
            time.sleep(0.05)
        pair.check_kv()
    finally:
        pair.close()


def test_dead_decode_peer_fails_the_prefill_and_frees(tiny_llama_dir):
    """The decode pool is unreachable (its transport closed): the prefill side's write
    fails, the request ends Failed with 503 and every prefill slot is back."""
    pair = EnginePair(tiny_llama_dir, max_total_tokens=1024, chunked_prefill_size=32)
    try:
        pair.d.pd.transport.close()  # its buffers are no longer registered: writes bounce
        p_out, d_out = pair.generate(rand_ids(200, 100, 6), dict(GREEDY, max_new_tokens=4))
        assert p_out["meta_info"]["finish_reason"]["status"] == 503
        assert d_out["meta_info"]["finish_reason"]["type"] == "error"
        assert "KV transfer" in d_out["meta_info"]["finish_reason"]["message"]
        pair.check_kv()
    finally:
        pair.close()


def test_reused_room_and_missing_destination(tiny_llama_dir):
    """A room already in use is refused at once; a request whose destination never comes
    fails after the bootstrap timeout, naming the setting; nothing is held afterwards."""
    import threading

    pair = EnginePair(tiny_llama_dir, max_total_tokens=1024,
                      disaggregation_bootstrap_timeout_s=1.0)
    try:
        sp = dict(GREEDY, max_new_tokens=2)
        first: dict = {}
        t = threading.Thread(target=lambda: first.update(out=pair.p.generate(
            input_ids=[5, 6, 7], sampling_params=sp, bootstrap=PDBootstrap(77, "d0"))))
        t.start()
        import time
        while not pair.p.call_in_loop(lambda s: 77 in s.pd.rooms):
            time.sleep(0.01)
        second = pair.p.generate(input_ids=[5, 6, 8], sampling_params=sp,
                                 bootstrap=PDBootstrap(77, "d0"))
        assert "already in use" in second["meta_info"]["finish_reason"]["message"]
        t.join(30)
        reason = first["out"]["meta_info"]["finish_reason"]
        assert reason["status"] == 503 and "disaggregation_bootstrap_timeout_s" in reason["message"]
        pair.check_kv()
    finally:
        pair.close()


def test_kv_pool_of_a_pd_engine_cannot_be_released(pair):
    pair.d.pause_generation("retract")
    try:
        with pytest.raises(ValueError, match="registered for KV transfer"):
            pair.d.release_memory_occupation(["kv_cache"])
    finally:
        pair.d.continue_generation()
