"""Tensor parallelism in-process: ``Engine(tp_size=N)`` starts N-1 follower processes (gloo
over loopback) that hold their shard of the weights and KV heads and follow the driver's
forward passes. Greedy tokens equal Hugging Face's (alone, batched, from the radix cache,
chunked) at TP 2 on tiny Llama, Qwen3, Qwen3-MoE and Qwen2-MoE (a shared expert), at TP 4
with KV heads replicated, and at TP 3 on the default model (9 query and 3 KV heads); at
TP 3 and 4, more ranks than this machine's CPUs, two of the prompts run alone (the batch
takes all); logprobs (output and prompt) stay within 1e-4 of TP 1; mixed chunks, n-gram speculation, grammars and retraction give TP 1's tokens; a
size that does not divide the heads, and what TP does not do yet, are refused by name."""

from __future__ import annotations

import random

import pytest
import torch
from model_fixtures import random_prompts, run_all_modes

from radixray import Engine
from radixray.engine.tp.sharding import TPShard

VOCAB = 350  # below every tiny model's vocabulary
GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}


def _hf(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.slow
@pytest.mark.parametrize("kind, tp", [("llama", 2), ("qwen3", 2), ("llama", 4),
                                      ("qwen3_moe", 2), ("qwen2_moe", 2)])
def test_greedy_equals_hf_in_every_mode(kind, tp, request):
    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    prompts = random_prompts(VOCAB)
    alone = None if tp <= 2 else (0, len(prompts) - 1)  # more ranks than CPUs: slow steps
    run_all_modes(model_dir, prompts, _hf(model_dir), f"{kind} tp{tp}", alone=alone,
                  tp_size=tp)


@pytest.mark.slow
def test_default_model_at_tp3_equals_hf(smollm2_refs):
    """SmolLM2-135M: 9 query heads and 3 KV heads divide by 3, not by 2."""
    prompts, refs = smollm2_refs
    run_all_modes("default", prompts, refs, "smollm2 tp3", alone=(0, len(prompts) - 1),
                  tp_size=3)


def _run(model_dir, tp, prompts, sp, **options):
    options = {"max_total_tokens": 4096, **options}
    with Engine(model=model_dir, dtype="float32", tp_size=tp, check_kv_conservation=True,
                **options) as eng:
        out = eng.generate(input_ids=prompts, sampling_params=sp)
        eng.check_kv_conservation()
        return out


def test_output_and_prompt_logprobs_within_1e_4_of_tp1(tiny_qwen3_dir):
    prompts = random_prompts(VOCAB)[:5]
    sp = {**GREEDY, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3}
    one, two = (_run(tiny_qwen3_dir, tp, prompts, sp) for tp in (1, 2))
    for a, b in zip(one, two):
        assert a["output_ids"] == b["output_ids"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            va = [v for v in a[key] if v is not None]
            vb = [v for v in b[key] if v is not None]
            assert len(va) == len(vb) > 0
            assert max(abs(x - y) for x, y in zip(va, vb)) < 1e-4, key


# (ignore_eos would make admission reserve every request's whole output: no retraction)
LONG = {"temperature": 0.0, "max_new_tokens": 120}


def _long_runners(model_dir) -> list[list[int]]:
    """40-token prompts whose greedy output runs the whole 120 tokens."""
    rng = random.Random(0)
    candidates = [[rng.randrange(1, VOCAB) for _ in range(40)] for _ in range(16)]
    outs = _run(model_dir, 1, candidates, LONG)
    return [p for p, o in zip(candidates, outs) if len(o["output_ids"]) == 120][:6]


@pytest.mark.slow
def test_mixed_chunks_speculation_grammar_and_retraction_give_tp1_tokens(tiny_llama_dir):
    prompts = random_prompts(VOCAB)
    schema = '{"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, ' \
             '"maximum": 99}}, "required": ["a"], "additionalProperties": false}'
    cases = [
        ({"enable_mixed_chunk": True, "chunked_prefill_size": 16}, GREEDY),
        ({"speculative_algorithm": "NGRAM"}, GREEDY),
        ({}, {**GREEDY, "json_schema": schema, "max_new_tokens": 40}),
        # 300 slots, admitted at conservativeness 0.3, for 40-token prompts that run 120
        # tokens: decode must retract some (as in test_retraction.py)
        ({"max_total_tokens": 300, "schedule_conservativeness": 0.3}, LONG),
    ]
    for options, sp in cases:
        ask = _long_runners(tiny_llama_dir) if sp is LONG else prompts
        one, two = (_run(tiny_llama_dir, tp, ask, sp, **options) for tp in (1, 2))
        assert [o["output_ids"] for o in one] == [o["output_ids"] for o in two], options
    assert sum(o["meta_info"]["num_retractions"] for o in two) > 0  # the last case retracts


def test_a_size_that_does_not_divide_the_heads_is_refused_by_name(tiny_llama_dir):
    with pytest.raises(ValueError, match="tp_size 3 does not divide the model's 4 attention"):
        Engine(model=tiny_llama_dir, dtype="float32", tp_size=3)


def test_what_tp_does_not_do_yet_is_refused_by_name(tiny_llama_dir, tiny_qwen3_moe_dir):
    with pytest.raises(ValueError, match="enable_eplb=True: expert rebalancing"):
        Engine(model=tiny_qwen3_moe_dir, dtype="float32", tp_size=2, enable_eplb=True)
    with pytest.raises(ValueError, match="enable_hierarchical_cache=True: the hierarchical"):
        Engine(model=tiny_llama_dir, dtype="float32", tp_size=2, enable_hierarchical_cache=True)


def test_memory_release_and_resume_at_tp2_keep_the_output(tiny_llama_dir):
    """Every rank frees its shard's KV and weights and gets them back: the same tokens."""
    prompts = random_prompts(VOCAB)[:4]
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=2048, tp_size=2,
                check_kv_conservation=True) as eng:
        before = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]
        eng.pause_generation("abort")
        freed = eng.release_memory_occupation()
        assert freed["released"] == ["cuda_graph", "kv_cache", "weights"] and freed["bytes"] > 0
        eng.resume_memory_occupation()
        eng.continue_generation()
        eng.flush_cache()
        after = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=GREEDY)]
        assert after == before
        eng.check_kv_conservation()


@pytest.mark.slow
def test_weight_updates_at_tp2_from_every_source_equal_hf(tiny_qwen3_dir, tmp_path):
    """Tensor, disk and a trainer's broadcast: each rank takes its slice of the full
    tensors, and greedy output equals HF's on the new weights; a rolled-back update (a
    refused version, then an abort) leaves every rank on the old weights."""
    from weight_helpers import assert_matches_hf, perturb, spawn_trainer

    from radixray.engine.weights.sync import WeightBroadcaster
    hf = _hf(tiny_qwen3_dir)
    prompts = random_prompts(VOCAB)[2:5]
    with Engine(model=tiny_qwen3_dir, dtype="float32", max_total_tokens=4096, tp_size=2,
                check_kv_conservation=True) as eng:
        eng.begin_weight_update()
        eng.update_weights_from_tensor(list(perturb(hf, seed=1).items()))
        eng.end_weight_update(1)
        assert_matches_hf(eng, hf, prompts, 12, "tp2 tensor update", version=1)

        perturb(hf, seed=2)
        hf.save_pretrained(tmp_path / "v2", safe_serialization=True)
        eng.begin_weight_update()
        eng.update_weights_from_disk(str(tmp_path / "v2"))
        eng.end_weight_update(2)
        assert_matches_hf(eng, hf, prompts, 12, "tp2 disk update", version=2)

        before = {n: p.detach().clone() for n, p in hf.named_parameters()}
        eng.begin_weight_update()
        eng.update_weights_from_tensor(list(perturb(hf, seed=4).items()))
        eng.abort_weight_update()
        with torch.no_grad():
            for n, p in hf.named_parameters():
                p.copy_(before[n])
        assert_matches_hf(eng, hf, prompts, 12, "tp2 after an aborted update", version=2)

        # released weights replaced by a full update (the colocated trainer's path)
        eng.pause_generation("retract")
        eng.release_memory_occupation(["weights"])
        eng.begin_weight_update()
        eng.update_weights_from_tensor(list(perturb(hf, seed=5).items()))
        eng.end_weight_update(4)
        eng.continue_generation()
        assert_matches_hf(eng, hf, prompts, 12, "tp2 update of released weights", version=4)

        named = dict(sorted(perturb(hf, seed=3).items()))
        trainer, port = spawn_trainer(named, tmp_path)
        try:
            eng.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2,
                                          group_name="g", backend="gloo")
            eng.begin_weight_update()
            eng.update_weights_from_distributed(*WeightBroadcaster.spec(named.items()),
                                                group_name="g")
            eng.end_weight_update(5)
            _, err = trainer.communicate(timeout=120)
            assert trainer.returncode == 0, err
        finally:
            trainer.kill()
        assert_matches_hf(eng, hf, prompts, 12, "tp2 distributed update", version=5)
        eng.check_kv_conservation()


class _Config:
    def __init__(self, q, kv, inter=160, vocab=357, hidden=64):
        self.num_attention_heads, self.num_key_value_heads = q, kv
        self.intermediate_size, self.vocab_size, self.hidden_size = inter, vocab, hidden


def test_the_shard_math_and_checkpoint_slices():
    cfg = _Config(q=8, kv=2)
    shards = [TPShard.of(cfg, r, 4) for r in range(4)]
    assert [s.kv_head_start for s in shards] == [0, 0, 1, 1]  # KV heads replicated twice
    assert [s.rows("q") for s in shards] == [(0, 16), (16, 16), (32, 16), (48, 16)]
    assert shards[3].rows("vocab") == (270, 90) and shards[3].local_vocab * 4 >= 357
    w = torch.arange(357 * 2, dtype=torch.float32).view(357, 2)
    last = shards[3].local("lm_head.weight", w)
    assert last.shape == (90, 2) and last[87:].abs().sum() == 0  # padding rows
    o = torch.ones(64, 64)
    assert shards[1].local("layers.0.self_attn.o_proj.weight", o).shape == (64, 16)
    assert shards[1].local("layers.0.self_attn.o_proj.bias", torch.ones(64)).sum() == 0
    assert shards[0].local("layers.0.mlp.down_proj.bias", torch.ones(64)).sum() == 64
    assert shards[2].local("layers.0.input_layernorm.weight", torch.ones(64)).shape == (64,)
    for bad, tp, words in ((_Config(q=9, kv=3), 2, "does not divide the model's 9 attention"),
                           (_Config(q=8, kv=3), 2, "neither divides the model's 3 KV heads"),
                           (_Config(q=8, kv=8, inter=150), 4, "intermediate_size 150")):
        with pytest.raises(ValueError, match=words):
            TPShard.of(bad, 0, tp)


@pytest.mark.slow
def test_the_tp_benchmark_reports_the_collectives_share(tiny_llama_dir, tmp_path, capsys):
    import json

    from radixray.cli import main
    out = tmp_path / "tp.json"
    main(["bench", "tp", "--model", tiny_llama_dir, "--tp-sizes", "1,2", "--requests", "2",
          "--prompt-len", "8", "--max-new-tokens", "4", "--repeats", "1", "--output", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [r["tp_size"] for r in rows] == [1, 2] and rows[0]["comm_calls"] == 0
    assert rows[1]["comm_calls"] > 0 and 0 < rows[1]["comm_share_of_forward"] < 1
    assert "B/tok/layer" in capsys.readouterr().out
