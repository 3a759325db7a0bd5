"""EPLB in one process (ep_size 1): redundant expert slots, rebalancing, and weight updates
that name logical experts.

A tiny Qwen3-MoE (top-2 of 8 experts, two MoE layers) with 3 spare slots per layer:
greedy equals Hugging Face; a skewed prompt mix (one token repeated sends nearly every
token of a layer to the same two experts) makes a rebalance raise balancedness, measured
on the same load, and leaves the tokens of a fixed prompt set unchanged; a rebalance
asked for during a weight-update session waits for it to end; an update writes every
copy of an expert and greedy then equals HF on the new weights; bad options are refused
by name.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from model_fixtures import random_prompts, run_all_modes, tiny_config
from weight_helpers import assert_matches_hf, perturb

from radixray import Engine
from radixray.engine.config import EngineConfig
from radixray.engine.ep.eplb_planner import keep_in_place, moves, plan
from radixray.engine.ep.eplb_stats import overall_balancedness
from radixray.engine.ep.expert_map import ExpertMap
from radixray.engine.models import model_class_for
from radixray.engine.weights.layout import WeightLayout, WeightStage

REDUNDANT = 3
GREEDY = {"temperature": 0.0, "ignore_eos": True}
SKEWED = [[5] * 40, [250] * 40, [300] * 40]  # each: ~all tokens of a layer to 2 experts


def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _engine(model_dir: str, **options) -> Engine:
    options = {"ep_num_redundant_experts": REDUNDANT, "enable_eplb": True,
               "eplb_rebalance_num_iterations": 0, **options}
    return Engine(model=model_dir, dtype="float32", max_total_tokens=4096,
                  check_kv_conservation=True, **options)


def _in_loop(eng: Engine, fn):
    return eng.call_in_loop(lambda s: fn(s.runner.model))


def _slot_weights(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(b.experts.gate_up_proj.detach().clone(), b.experts.down_proj.detach().clone())
            for b in model.moe_blocks]


def _expert_weights(hf, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's expert ``expert`` of decoder layer ``layer`` as (gate|up rows, down)."""
    experts = hf.model.layers[layer].mlp.experts
    return experts.gate_up_proj[expert].detach(), experts.down_proj[expert].detach()


def _assert_every_slot_holds_its_expert(eng: Engine, hf, label: str) -> None:
    """Every physical slot of every MoE layer holds exactly HF's weights of the expert the
    placement says it holds (so every copy of an expert was written)."""
    model = eng.runner.model
    weights = _in_loop(eng, _slot_weights)
    p2l = _in_loop(eng, lambda m: m.expert_map.placement.physical_to_logical.clone())
    for row, layer in enumerate(model.moe.sparse_layers):
        for slot, expert in enumerate(p2l[row].tolist()):
            gate_up, down = _expert_weights(hf, layer, expert)
            assert torch.equal(weights[row][0][slot], gate_up), f"{label}: layer {layer} slot {slot}"
            assert torch.equal(weights[row][1][slot], down), f"{label}: layer {layer} slot {slot}"


def test_redundant_copies_match_hf_and_a_rebalance_evens_skewed_load(tiny_qwen3_moe_dir):
    hf = _hf(tiny_qwen3_moe_dir)
    fixed = [random_prompts(hf.config.vocab_size)[i] for i in (0, 3, 6)]
    from radixray.cluster.metrics import WorkerMetrics, worker_load
    with _engine(tiny_qwen3_moe_dir) as eng:
        start = _in_loop(eng, lambda m: m.expert_map.placement)
        assert start.num_physical == 8 + REDUNDANT and int(start.logical_count.max()) == 2
        _assert_every_slot_holds_its_expert(eng, hf, "loaded")
        before = assert_matches_hf(eng, hf, fixed, 12, "3 spare slots")
        eng.generate(input_ids=SKEWED * 2, sampling_params={**GREEDY, "max_new_tokens": 4})
        load = eng.call_in_loop(lambda s: s.runner.eplb.window.totals())
        hot = load.topk(2, dim=1).values.sum(1) / load.sum(1)
        assert bool((hot > 0.4).all()), f"the prompt mix is not skewed: {hot.tolist()}"

        report = eng.rebalance_experts()
        after_placement = _in_loop(eng, lambda m: m.expert_map.placement)
        # balancedness of both placements on the same load, recomputed here
        assert report["balancedness_before"] == pytest.approx(overall_balancedness(load, start))
        assert report["balancedness_after"] == pytest.approx(
            overall_balancedness(load, after_placement))
        assert report["applied"] and report["balancedness_after"] > report["balancedness_before"]
        assert report["experts_moved"] == moves(start, after_placement) > 0
        # only new copies are written: an expert that keeps a copy keeps its slot
        gained = (after_placement.logical_count - start.logical_count).clamp(min=0)
        assert report["experts_moved"] == int(gained.sum())
        for row in range(load.shape[0]):  # the hottest expert of each layer got a copy
            assert int(after_placement.logical_count[row, int(load[row].argmax())]) >= 2
        _assert_every_slot_holds_its_expert(eng, hf, "rebalanced")

        eng.flush_cache()  # recompute every prompt under the new placement
        again = eng.generate(input_ids=fixed, sampling_params={**GREEDY, "max_new_tokens": 12})
        assert [o["output_ids"] for o in again] == [o["output_ids"] for o in before]
        families = {f.name: f for f in WorkerMetrics("w").families(worker_load(eng.snapshot()))}
        assert families["radixray:eplb_rebalances"].samples[0].value == 1
        assert 0 < families["radixray:eplb_balancedness"].samples[0].value <= 1


def test_greedy_with_spare_slots_matches_hf_alone_batched_cached_chunked(tiny_qwen3_moe_dir):
    """Tokens spread over two copies of experts 0-2 (all modes of test_moe_models)."""
    hf = _hf(tiny_qwen3_moe_dir)
    prompts = [random_prompts(hf.config.vocab_size)[i] for i in (3, 6)]
    run_all_modes(tiny_qwen3_moe_dir, prompts, hf, "3 spare slots",
                  ep_num_redundant_experts=REDUNDANT)


def test_a_rebalance_waits_for_the_open_weight_update_session(tiny_qwen3_moe_dir):
    """Asked for while a session is open, the rebalance runs once it ended, on the new
    weights; a periodic one that comes due in a session is put off the same way."""
    hf = _hf(tiny_qwen3_moe_dir)
    new = perturb(hf, seed=3)
    with _engine(tiny_qwen3_moe_dir, eplb_rebalance_num_iterations=3) as eng:
        eng.generate(input_ids=SKEWED, sampling_params={**GREEDY, "max_new_tokens": 4})
        periodic = eng.call_in_loop(lambda s: s.runner.eplb.rebalances)
        assert periodic == 1  # 4 passes (prefill + 3 decodes), due after the third
        placement = _in_loop(eng, lambda m: m.expert_map.placement)
        eng.begin_weight_update()
        eng.update_weights_from_tensor(new)
        result: dict = {}
        asker = threading.Thread(target=lambda: result.update(eng.rebalance_experts(timeout=60)))
        asker.start()
        # forward passes in the session: three more passes make a periodic one due
        eng.generate(input_ids=SKEWED[::-1], sampling_params={**GREEDY, "max_new_tokens": 3})
        time.sleep(0.2)
        assert asker.is_alive() and not result
        assert _in_loop(eng, lambda m: m.expert_map.placement) is placement
        balancer = eng.runner.eplb
        assert eng.call_in_loop(lambda s: (balancer.rebalances, balancer.due)) == (periodic, True)
        eng.end_weight_update(weight_version=1)
        asker.join(30)
        assert not asker.is_alive() and result["trigger"] == "request"
        assert eng.call_in_loop(lambda s: balancer.deferred) >= 2  # the request, the periodic one
        _assert_every_slot_holds_its_expert(eng, hf, "updated, then rebalanced")
        assert_matches_hf(eng, hf, SKEWED[:1] + random_prompts(hf.config.vocab_size)[2:3], 8,
                          "after the session", version=1)


def test_an_update_writes_every_copy_and_greedy_equals_hf(tiny_qwen3_moe_dir):
    """A whole new model by transformers' in-memory names lands in every slot; the rebalance
    after it copies the new weights; then one expert's tensor by its checkpoint name lands
    in all the slots the new placement gives that expert and nowhere else, and greedy
    equals HF on the result."""
    hf = _hf(tiny_qwen3_moe_dir)
    with _engine(tiny_qwen3_moe_dir) as eng:
        new = perturb(hf, seed=7)
        assert "model.layers.0.mlp.experts.gate_up_proj" in new  # the stacked name
        eng.begin_weight_update()
        eng.update_weights_from_tensor(new)
        eng.end_weight_update(weight_version=1)
        _assert_every_slot_holds_its_expert(eng, hf, "full update")

        eng.generate(input_ids=SKEWED, sampling_params={**GREEDY, "max_new_tokens": 2})
        start = _in_loop(eng, lambda m: m.expert_map.placement.physical_to_logical.clone())
        eng.rebalance_experts()
        _assert_every_slot_holds_its_expert(eng, hf, "full update, then rebalanced")
        p2l = _in_loop(eng, lambda m: m.expert_map.placement.physical_to_logical.clone())
        expert = int(torch.bincount(p2l[0]).argmax())  # decoder layer 0 is MoE row 0
        slots = (p2l[0] == expert).nonzero().flatten().tolist()
        # the layout of the first session would write other slots
        assert len(slots) >= 2 and slots != (start[0] == expert).nonzero().flatten().tolist()
        old = _in_loop(eng, _slot_weights)
        up = torch.randn(32, 64) * 0.2
        eng.begin_weight_update()
        eng.update_weights_from_tensor({f"model.layers.0.mlp.experts.{expert}.up_proj.weight": up})
        eng.end_weight_update(weight_version=2)
        now = _in_loop(eng, _slot_weights)
        for slot in range(p2l.shape[1]):
            expected = old[0][0][slot].clone()
            if slot in slots:
                expected[32:] = up
            assert torch.equal(now[0][0][slot], expected), f"slot {slot}"
        assert all(torch.equal(a, b) for (a, b) in zip(old[1], now[1]))
        with torch.no_grad():
            hf.model.layers[0].mlp.experts.gate_up_proj[expert, 32:] = up
        _assert_every_slot_holds_its_expert(eng, hf, "one expert updated")
        assert_matches_hf(eng, hf, SKEWED[:1] + random_prompts(hf.config.vocab_size)[1:4], 10,
                          "updated", version=2)


def test_a_rebalance_is_refused_while_the_weights_are_released(tiny_qwen3_moe_dir):
    with _engine(tiny_qwen3_moe_dir) as eng:
        eng.pause_generation()
        eng.release_memory_occupation(["weights"])
        with pytest.raises(ValueError, match="the weights are released"):
            eng.rebalance_experts(timeout=5)
        eng.resume_memory_occupation()
        eng.continue_generation()
        assert eng.rebalance_experts()["trigger"] == "request"


def test_the_layout_writes_copies_by_every_path():
    """Per-expert names (tensor or received in place), the stacked name, and a partial
    update's unsent rows all reach every slot of an expert."""
    config = tiny_config("qwen3_moe", 64)
    model = model_class_for(config)(config, num_redundant_experts=REDUNDANT)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    experts = model.layers[0].mlp.experts
    p2l = model.expert_map.placement.physical_to_logical[0]
    shard = WeightLayout(model).locate("model.layers.0.mlp.experts.1.down_proj.weight")
    assert [shard.index, *shard.copies] == (p2l == 1).nonzero().flatten().tolist()
    stage = WeightStage(WeightLayout(model))
    down = torch.randn(64, 32)
    stage.buffer_for("model.layers.0.mlp.experts.1.down_proj.weight", torch.float32).copy_(down)
    stage.mark_written("model.layers.0.mlp.experts.1.down_proj.weight")
    stacked = torch.randn(8, 64, 64)  # gate|up of every logical expert
    stage.add("model.layers.0.mlp.experts.gate_up_proj", stacked)
    before = experts.down_proj.detach().clone()
    stage.prepare().commit()
    first = {e: p2l.tolist().index(e) for e in range(8)}  # unsent rows: from the first copy
    for slot, expert in enumerate(p2l.tolist()):
        assert torch.equal(experts.gate_up_proj[slot], stacked[expert])
        assert torch.equal(experts.down_proj[slot], down if expert == 1 else before[first[expert]])


def test_keep_in_place_keeps_experts_and_balance():
    load = torch.tensor([[900.0, 10, 10, 10, 500, 10, 10, 10], [5, 5, 5, 800, 5, 5, 700, 5]])
    start = ExpertMap.initial(2, 8, REDUNDANT).placement
    raw = plan(load, start.num_ranks, num_redundant=REDUNDANT)
    kept = keep_in_place(start, raw)
    assert overall_balancedness(load, kept) == pytest.approx(overall_balancedness(load, raw))
    assert torch.equal(kept.logical_count, raw.logical_count)
    # at ep_size 1 each slot is a rank: a slot is rewritten only for a copy that changed
    changed = int((kept.logical_count - start.logical_count).clamp(min=0).sum())
    assert moves(start, kept) == changed < moves(start, raw)


def test_transfers_copy_within_a_rank_when_they_can():
    """Two ranks of 3 slots. Rank 1 swaps experts 1 and 3 between its slots (local copies,
    read before written) and trades expert 2 for expert 0, whose only copy is on rank 0;
    every rank computes the same list."""
    from radixray.engine.ep.eplb_planner import ExpertPlacement
    old = ExpertPlacement.from_physical_to_logical(torch.tensor([[0, 1, 2, 1, 3, 2]]), 4, 2)
    new = ExpertPlacement.from_physical_to_logical(torch.tensor([[0, 1, 2, 3, 1, 0]]), 4, 2)
    maps = [ExpertMap(old, ep_rank=r, ep_size=2) for r in range(2)]
    assert maps[0].transfers(new) == maps[1].transfers(new) == [[(3, 4), (4, 3), (5, 0)]]
    alone = ExpertMap(old)  # ep_size 1: every slot is local, the lowest one holding it
    assert alone.transfers(new) == [[(3, 4), (4, 1), (5, 0)]]


@pytest.mark.parametrize("options, field", [
    ({"ep_num_redundant_experts": -1}, "ep_num_redundant_experts must be >= 0"),
    ({"eplb_window_size": 0}, "eplb_window_size must be >= 1"),
    ({"eplb_rebalance_num_iterations": -5}, "eplb_rebalance_num_iterations must be >= 0"),
])
def test_bad_eplb_options_are_refused_by_name(options, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**options)


@pytest.mark.parametrize("options, field", [
    ({"enable_eplb": True}, "enable_eplb=True needs a mixture-of-experts model"),
    ({"ep_num_redundant_experts": 2}, "ep_num_redundant_experts=2 needs a mixture-of-experts"),
])
def test_eplb_on_a_dense_model_is_a_start_up_error(tiny_llama_dir, options, field):
    with pytest.raises(ValueError, match=field):
        Engine(model=tiny_llama_dir, max_total_tokens=256, **options)


def test_redundant_expert_bounds_name_the_option(tiny_qwen3_moe_dir):
    """The planner's bound (a rank holds at most one copy of an expert) and the slot split
    over EP ranks; asking for a rebalance without enable_eplb."""
    with pytest.raises(ValueError, match=r"ep_num_redundant_experts=10 .*<= num_logical \* "
                                         r"\(num_ranks - 1\) = 8"):
        ExpertMap.initial(2, 8, 10, ep_size=2)
    with pytest.raises(ValueError, match=r"ep_num_redundant_experts.*\(3\) must be divisible "
                                         r"by ep_size \(2\)"):
        ExpertMap.initial(2, 8, 3, ep_size=2)
    with Engine(model=tiny_qwen3_moe_dir, max_total_tokens=256, ep_num_redundant_experts=1) as eng:
        with pytest.raises(ValueError, match="enable_eplb"):
            eng.rebalance_experts()


def test_a_serving_worker_rebalances_on_request(tiny_qwen3_moe_dir):
    """What POST /fleet/eplb/rebalance runs on each worker (the controller fans it out)."""
    import asyncio

    from radixray.actors.engine_worker import EngineWorker
    worker = EngineWorker({"model": tiny_qwen3_moe_dir, "dtype": "float32",
                           "max_total_tokens": 2048, "enable_eplb": True,
                           "ep_num_redundant_experts": 2, "eplb_rebalance_num_iterations": 0})
    try:
        report = asyncio.run(worker.rebalance_experts())
        assert report["applied"] and report["trigger"] == "request"
        assert 0 < report["balancedness_before"] <= 1 and 0 < report["balancedness_after"] <= 1
    finally:
        asyncio.run(worker.shutdown())
