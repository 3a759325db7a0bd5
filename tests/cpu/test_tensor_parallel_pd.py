"""Prefill-decode pairs whose halves run different tensor-parallel sizes: in-process (one
TP engine per process, the other half at TP 1; the TP engine starts its follower
processes), and served (TP 2 prefill, TP 4 decode, each worker its own process). The KV
moves over Mooncake's TCP transport, every rank writing its own KV heads into the decode
ranks that hold them. The tiny Llama has 4 query and 2 KV heads: at TP 4 each KV head is
held by two ranks. Greedy tokens equal a unified TP 1 engine's, whole prompts and chunked
ones, with a prefix cached on the decode side; every KV slot is accounted for on both
sides."""

from __future__ import annotations

import pytest
from model_fixtures import random_prompts
from pd_helpers import EnginePair

from radixray import Engine

VOCAB = 350
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(VOCAB)[3:7]  # 17-48 tokens; the last two share 20


@pytest.fixture(scope="module")
def unified(tiny_llama_dir, prompts):
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096) as eng:
        return [r["output_ids"] for r in eng.generate(input_ids=prompts,
                                                      sampling_params=GREEDY)]


def _pair(model_dir, prefill_tp: int, decode_tp: int, **options) -> EnginePair:
    return EnginePair(model_dir, {"tp_size": prefill_tp}, {"tp_size": decode_tp},
                      max_total_tokens=4096, **options)


@pytest.mark.slow
@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (2, 1), (1, 4), (4, 1)])
def test_a_pair_of_different_tp_sizes_gives_unified_tokens(tiny_llama_dir, prompts, unified,
                                                            prefill_tp, decode_tp):
    pair = _pair(tiny_llama_dir, prefill_tp, decode_tp)
    try:
        assert pair.p.pd.endpoint.tp_size == prefill_tp
        assert pair.d.pd.endpoint.tp_size == decode_tp
        assert pair.p.pd_probe(pair.d.pd_endpoint()) > 0
        for prompt, want in zip(prompts, unified):
            _, out = pair.generate(prompt, GREEDY)
            assert out["output_ids"] == want, (prefill_tp, decode_tp)
        # the same prompt again: the decode side holds its prefix, only the rest moves
        _, again = pair.generate(prompts[0], GREEDY)
        assert again["output_ids"] == unified[0]
        pair.check_kv()
    finally:
        pair.close()


def test_chunked_prefill_at_tp2_into_one_rank(tiny_llama_dir, prompts, unified):
    """Each chunk's KV is one job: the follower writes its heads of every chunk."""
    pair = _pair(tiny_llama_dir, 2, 1, chunked_prefill_size=16)
    try:
        for prompt, want in zip(prompts, unified):
            p, out = pair.generate(prompt, GREEDY)
            assert out["output_ids"] == want
        pair.check_kv()
    finally:
        pair.close()


@pytest.mark.slow
def test_served_pd_fleet_with_a_tp2_prefill_and_a_tp4_decode_worker(tiny_llama_dir):
    """`fleet.prefill_engine: {tp_size: 2}`, `decode_engine: {tp_size: 4}`: each worker
    reserves its ranks' worth; the handshake probes every rank pair; the openai client gets
    a unified engine's tokens."""
    import httpx
    from openai import OpenAI
    from serving_helpers import free_port, served, tiny_config

    texts = ["a pair of two sizes", "the decode worker has one rank"]
    sp = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096) as eng:
        want = [eng.generate(t, sp)["text"] for t in texts]
    cfg = tiny_config(tiny_llama_dir, free_port(), worker_num_cpus=0.25)
    cfg["fleet"] = {"prefill_workers": 1, "decode_workers": 1,
                    "prefill_engine": {"tp_size": 2}, "decode_engine": {"tp_size": 4}}
    with served(cfg) as base:
        fleet = httpx.get(f"{base}/fleet", timeout=60).json()
        assert sorted(w["role"] for w in fleet["workers"]) == ["decode", "prefill"]
        client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        for text, expected in zip(texts, want):
            out = client.completions.create(model="tiny", prompt=text, max_tokens=10,
                                            temperature=0, extra_body={"ignore_eos": True})
            assert out.choices[0].text == expected


def test_a_second_tp_engine_in_one_process_is_refused(tiny_llama_dir, monkeypatch):
    """Ranks join torch.distributed's default group: one TP engine per process (a fleet
    runs each worker in a process of its own). The refusal comes before any follower
    process starts (followers waiting for a group that never forms took 30 s each to stop)."""
    from radixray.engine.tp import launch
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=1024, tp_size=2):
        started = []
        monkeypatch.setattr(launch, "LocalFollowers",
                            lambda *a: started.append(a) or pytest.fail("followers started"))
        with pytest.raises(ValueError, match="one tensor-parallel engine of tp_size 4"):
            Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=1024, tp_size=4)
        assert started == []
