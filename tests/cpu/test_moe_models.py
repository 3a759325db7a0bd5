"""Mixture-of-experts models (Qwen3-MoE, Mixtral, Qwen2-MoE): greedy tokens equal Hugging Face
transformers' (fp32, same weights), the recorded routed experts equal the HF routers' top-k on
the same tokens, the expert-load counters add up to them, both checkpoint namings load, and a
config the engine cannot run is refused by name."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import (
    assert_greedy_equal,
    hf_greedy,
    random_prompts,
    run_all_modes,
    tiny_config,
)

from radixray import Engine
from radixray.engine.models import model_class_for
from radixray.engine.models.routed_experts import RoutedExpertsRecord
from radixray.engine.weights.layout import WeightLayout, WeightStage

GREEDY = {"temperature": 0.0, "ignore_eos": True}
NEAR_TIE = 1e-5  # routing probabilities closer than this may order differently


def _prompts(vocab: int) -> list[list[int]]:
    """Four of the shared random prompts: 3, 17, 33 and 48 tokens (the last two share a
    20-token prefix; three cross a 16-token chunk). Fewer prompts keep the HF reference,
    which loops over experts in Python, inside the time budget."""
    prompts = random_prompts(vocab)
    return [prompts[i] for i in (0, 3, 5, 6)]


def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_greedy_matches_hf_alone_batched_cached_chunked(kind, request):
    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    hf = _hf(model_dir)
    run_all_modes(model_dir, _prompts(hf.config.vocab_size), hf, kind)


def test_shared_expert_model_matches_hf(tiny_qwen2_moe_dir):
    """Qwen2-MoE: top-k without renormalization plus a sigmoid-gated shared expert."""
    hf = _hf(tiny_qwen2_moe_dir)
    prompts = _prompts(hf.config.vocab_size)[:3]
    with Engine(model=tiny_qwen2_moe_dir, dtype="float32", max_total_tokens=4096) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 12})
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref, gaps = hf_greedy(hf, p, 12)
        assert_greedy_equal(out["output_ids"], ref, gaps, f"qwen2_moe prompt {i}")


def _hf_router_probs(hf, ids: list[int]) -> torch.Tensor:
    """HF's routing probabilities ``[tokens, MoE layers, experts]`` for ``ids`` in one pass."""
    with torch.inference_mode():
        out = hf(input_ids=torch.tensor([ids]), output_router_logits=True)
    return torch.stack([torch.softmax(g.float(), dim=-1) for g in out.router_logits], dim=1)


def _assert_routes_equal(ours: list, probs: torch.Tensor, k: int, label: str) -> None:
    """Equal top-k ids (in order), except at a near-tie of routing probabilities, after which
    the token's hidden state may differ and the comparison stops."""
    ref = torch.topk(probs, k, dim=-1).indices.tolist()
    assert len(ours) == len(ref), f"{label}: {len(ours)} routed tokens vs {len(ref)}"
    for t, (a, b) in enumerate(zip(ours, ref)):
        for layer, (x, y) in enumerate(zip(a, b)):
            if x != y:
                top = probs[t, layer].sort(descending=True).values[:k + 1]
                gap = float((top[:-1] - top[1:]).min())
                assert gap < NEAR_TIE, f"{label}: token {t} layer {layer}: ours {x} vs HF {y}"
                print(f"[near-tie] {label}: token {t} layer {layer} gap {gap:.1e}; stops here")
                return


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_routed_experts_equal_hf_router_and_feed_the_load_counters(kind, request):
    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    hf = _hf(model_dir)
    k = hf.config.num_experts_per_tok
    prompts = _prompts(hf.config.vocab_size)
    params = {**GREEDY, "max_new_tokens": 10, "return_routed_experts": True}
    with Engine(model=model_dir, dtype="float32", max_total_tokens=4096,
                chunked_prefill_size=16) as eng:
        eng.call_in_loop(lambda s: s.runner.model.expert_load(reset=True))
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        # the first prompt again: all but its last token come from the radix cache
        outs.append(eng.generate(input_ids=prompts[0], sampling_params=params))
        load = eng.call_in_loop(lambda s: s.runner.model.expert_load())
        plain = eng.generate(input_ids=prompts[1], sampling_params={**GREEDY, "max_new_tokens": 2})
    assert "routed_experts" not in plain["meta_info"]
    num_moe_layers = len(_hf_router_probs(hf, prompts[0][:1])[0])
    assert load.shape == (num_moe_layers, 8)
    expected_load = torch.zeros_like(load)
    for i, (p, out) in enumerate(zip(prompts + prompts[:1], outs)):
        meta = out["meta_info"]
        start, routes = meta["routed_experts_start"], meta["routed_experts"]
        # positions start .. prompt + output - 2: the last output token is never computed
        assert start == meta["cached_tokens"]
        assert len(routes) == len(p) + len(out["output_ids"]) - 1 - start
        assert all(len(layers) == num_moe_layers and all(len(e) == k for e in layers)
                   for layers in routes)
        seq = p + out["output_ids"][:-1]
        _assert_routes_equal(routes, _hf_router_probs(hf, seq)[start:], k, f"{kind} prompt {i}")
        ids = torch.tensor(routes).transpose(0, 1).reshape(num_moe_layers, -1)
        expected_load += torch.stack([torch.bincount(r, minlength=8) for r in ids])
    assert outs[-1]["meta_info"]["routed_experts_start"] == len(prompts[0]) - 1
    assert torch.equal(load, expected_load)  # every computed token counted once per expert


def test_routes_by_slot_cover_the_cached_prefix(tiny_qwen3_moe_dir):
    """enable_return_routed_experts: a request whose prompt comes from the radix cache gets
    the routes of its whole sequence from position 0, equal to the HF routers' top-k."""
    hf = _hf(tiny_qwen3_moe_dir)
    k = hf.config.num_experts_per_tok
    prompts = _prompts(hf.config.vocab_size)[:2]
    params = {**GREEDY, "max_new_tokens": 6, "return_routed_experts": True}
    with Engine(model=tiny_qwen3_moe_dir, dtype="float32", max_total_tokens=4096,
                enable_return_routed_experts=True, check_kv_conservation=True) as eng:
        first = eng.generate(input_ids=prompts[0], sampling_params=params)
        again = eng.generate(input_ids=prompts[0] + first["output_ids"][:3],
                             sampling_params=params)
        plain = eng.generate(input_ids=prompts[1], sampling_params={**GREEDY, "max_new_tokens": 2})
    assert "routed_experts" not in plain["meta_info"]
    assert again["meta_info"]["cached_tokens"] >= len(prompts[0])
    for label, prompt, out in (("first", prompts[0], first),
                               ("cached", prompts[0] + first["output_ids"][:3], again)):
        meta = out["meta_info"]
        assert meta["routed_experts_start"] == 0
        seq = prompt + out["output_ids"][:-1]
        assert len(meta["routed_experts"]) == len(seq)
        _assert_routes_equal(meta["routed_experts"], _hf_router_probs(hf, seq), k, label)


def test_routes_by_slot_need_a_moe_model_and_no_disaggregation(tiny_llama_dir,
                                                                tiny_qwen3_moe_dir):
    with pytest.raises(ValueError, match="enable_return_routed_experts=True needs a mixture"):
        Engine(model=tiny_llama_dir, dtype="float32", enable_return_routed_experts=True)
    from radixray.engine.config import EngineConfig
    with pytest.raises(ValueError, match="enable_return_routed_experts with disaggregation"):
        EngineConfig.from_kwargs(model=tiny_qwen3_moe_dir, enable_return_routed_experts=True,
                                 disaggregation_mode="prefill")


def test_routed_experts_record_keeps_positions_through_recomputation():
    rec = RoutedExpertsRecord()
    rows = torch.arange(10 * 2 * 2).reshape(10, 2, 2)
    rec.add(3, rows[3:6])  # a prefill after a 3-token cached prefix
    rec.add(6, rows[6:7])  # decode
    assert rec.start == 3 and len(rec) == 4
    rec.add(5, rows[5:9])  # retracted, then run again from position 5
    assert rec.to_list() == rows[3:9].tolist()
    rec.add(0, rows[0:2])  # run again with no cached prefix: starts over
    assert rec.start == 0 and rec.to_list() == rows[0:2].tolist()


def test_transformers_in_memory_names_update_the_stacked_experts(tiny_mixtral_dir):
    """A trainer's ``state_dict`` names (transformers keeps experts fused:
    ``mlp.experts.gate_up_proj``) update a model loaded from per-expert checkpoint names
    (Mixtral's ``block_sparse_moe.experts.E.w1``); greedy then equals the new model."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(tiny_mixtral_dir)
    torch.manual_seed(1)
    new = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    names = list(new.state_dict())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    prompts = _prompts(config.vocab_size)[:2]
    with Engine(model=tiny_mixtral_dir, dtype="float32", max_total_tokens=4096) as eng:
        eng.begin_weight_update()
        eng.update_weights_from_tensor(list(new.state_dict().items()))
        eng.end_weight_update(weight_version=1)
        outs = eng.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 12})
    for i, (p, out) in enumerate(zip(prompts, outs)):
        ref, gaps = hf_greedy(new, p, 12)
        assert_greedy_equal(out["output_ids"], ref, gaps, f"updated mixtral prompt {i}")


def test_one_expert_tensor_fills_its_slice_only():
    config = tiny_config("mixtral", 64)
    model = model_class_for(config)(config)
    layout = WeightLayout(model)
    inter = config.intermediate_size
    shard = layout.locate("model.layers.1.block_sparse_moe.experts.3.w3.weight")
    assert (shard.target, shard.index, shard.offset, shard.shape) == \
        ("layers.1.mlp.experts.gate_up_proj", 3, inter, (inter, config.hidden_size))
    assert layout.locate("layers.1.mlp.experts.5.down_proj.weight").index == 5
    with torch.no_grad():  # parameters start uninitialized: NaN would never compare equal
        model.layers[1].mlp.experts.gate_up_proj.normal_()
    before = model.layers[1].mlp.experts.gate_up_proj.detach().clone()
    stage = WeightStage(layout)
    new = torch.randn(inter, config.hidden_size)
    stage.add("model.layers.1.block_sparse_moe.experts.3.w3.weight", new)
    stage.prepare().commit()
    after = model.layers[1].mlp.experts.gate_up_proj.detach().clone()
    assert torch.equal(after[3, inter:], new)
    after[3, inter:] = before[3, inter:]
    assert torch.equal(after, before)


@pytest.mark.parametrize("change, field", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"sliding_window": 64}, "sliding_window"),
])
def test_a_config_the_engine_cannot_run_is_refused_by_name(change, field):
    config = tiny_config("mixtral", 64)
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=field):
        model_class_for(config)(config)


def test_routed_experts_of_a_dense_model_is_a_clear_error(eng):
    with pytest.raises(ValueError, match="return_routed_experts"):
        eng.generate(input_ids=[1, 2, 3], sampling_params={"return_routed_experts": True})
