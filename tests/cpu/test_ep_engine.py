"""Expert parallelism in the engine: two engines (one process each, gloo on 127.0.0.1) form
an EP group over a tiny MoE model; each holds half of the expert slots and its own
requests. Every rank's greedy tokens equal Hugging Face's on the full model, whether both
ranks have requests or one has none (it joins every MoE exchange with an empty batch),
and the group stops together. With EPLB on, a rebalance asked of one rank runs on both,
for their summed load, after a weight-update session open on the other rank ends; expert
weights cross between the ranks, every slot then holds HF's weights of the expert the new
placement gives it, and the tokens of a fixed prompt set do not change.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp
from model_fixtures import assert_greedy_equal, hf_greedy, random_prompts

from radixray.engine.config import EngineConfig
from radixray.engine.ep.group import free_tcp_address, join_ep_group

NEW_TOKENS = 12
SKEWED = [[5] * 40, [250] * 40, [300] * 40]  # each: ~all tokens of a layer to 2 experts
DEADLINE_S = 240.0
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}

mp.get_context("forkserver").set_forkserver_preload(["torch", "radixray.engine.engine"])


def _rank(rank: int, size: int, address: str, model_dir: str, prompts: list[list[list[int]]],
          results, done) -> None:
    """One rank: an engine in the group; its prompts as one batch; wait for every rank
    before stopping (a rank that stops stops the group)."""
    from radixray import Engine
    eng = Engine(model=model_dir, dtype="float32", max_total_tokens=2048, num_threads=1,
                 ep_size=size, ep_rank=rank, ep_init_method=address, ep_timeout_s=60)
    try:
        mine = prompts[rank]
        outs = eng.generate(input_ids=mine, sampling_params=GREEDY) if mine else []
        results.put((rank, [o["output_ids"] for o in outs], eng.scheduler.ep is not None))
        done.wait(DEADLINE_S)
    finally:
        eng.shutdown()


def _run_group(model_dir: str, prompts: list[list[list[int]]]) -> dict[int, list]:
    ctx = mp.get_context("forkserver")
    results, done = ctx.Queue(), ctx.Event()
    size = len(prompts)
    address = free_tcp_address()
    procs = [ctx.Process(target=_rank, args=(r, size, address, model_dir, prompts, results,
                                             done), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    out, deadline = {}, time.monotonic() + DEADLINE_S
    try:
        while len(out) < size:
            rank, ids, grouped = results.get(timeout=max(1.0, deadline - time.monotonic()))
            assert grouped, f"rank {rank} left its group"
            out[rank] = ids
        done.set()
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
            assert p.exitcode == 0, f"a rank exited with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return out


def _eplb_rank(rank: int, size: int, address: str, model_dir: str, prompts, results, done,
               barrier) -> None:
    """One rank of a group with EPLB: fixed prompts, a skewed mix, then rank 0 asks for a
    rebalance while rank 1 holds a weight-update session open; the fixed prompts again."""
    from radixray import Engine
    eng = Engine(model=model_dir, dtype="float32", max_total_tokens=4096, num_threads=1,
                 ep_size=size, ep_rank=rank, ep_init_method=address, ep_timeout_s=60,
                 ep_num_redundant_experts=2, enable_eplb=True, eplb_rebalance_num_iterations=0,
                 check_kv_conservation=True)

    def in_loop(fn):
        return eng.call_in_loop(lambda s: fn(s.runner.model, s.runner.eplb))

    try:
        greedy = {**GREEDY, "max_new_tokens": 8}
        before = eng.generate(input_ids=prompts[rank], sampling_params=greedy)
        eng.generate(input_ids=SKEWED, sampling_params={**GREEDY, "max_new_tokens": 4})
        start = in_loop(lambda m, _: m.expert_map.placement)
        if rank == 1:
            eng.begin_weight_update()
        barrier.wait(DEADLINE_S)  # both loads recorded; rank 1's session open
        if rank == 0:
            import threading
            answer = {}
            asking = threading.Thread(target=lambda: answer.update(eng.rebalance_experts()))
            asking.start()
            deadline = time.monotonic() + DEADLINE_S
            while in_loop(lambda _, b: b.deferred) == 0:  # held off by rank 1's session
                assert time.monotonic() < deadline, "the rebalance was never held off"
                time.sleep(0.02)
            deferred_while_open = in_loop(lambda _, b: b.rebalances) == 0
            barrier.wait(DEADLINE_S)
            asking.join(DEADLINE_S)
            report = answer
        else:
            barrier.wait(DEADLINE_S)  # rank 0's request is waiting on this session
            eng.abort_weight_update()
            deadline = time.monotonic() + DEADLINE_S
            while in_loop(lambda _, b: b.rebalances) == 0:  # the group's one rebalance
                assert time.monotonic() < deadline, "rank 1 never rebalanced"
                time.sleep(0.02)
            report = in_loop(lambda _, b: b.last.as_dict())
            deferred_while_open = True
        after = in_loop(lambda m, _: m.expert_map.placement)
        slots = in_loop(lambda m, _: [(b.experts.gate_up_proj.detach().clone(),
                                       b.experts.down_proj.detach().clone())
                                      for b in m.moe_blocks])
        eng.flush_cache()  # recompute every prompt under the new placement
        again = eng.generate(input_ids=prompts[rank], sampling_params=greedy)
        results.put((rank, {"before": [o["output_ids"] for o in before],
                            "again": [o["output_ids"] for o in again], "report": report,
                            "start": start, "after": after, "slots": slots,
                            "deferred_while_open": deferred_while_open,
                            "grouped": eng.scheduler.ep is not None}))
        done.wait(DEADLINE_S)
    finally:
        eng.shutdown()


def test_ep2_rebalance_moves_experts_between_ranks(tiny_qwen3_moe_dir):
    from radixray.engine.ep.eplb_planner import moves
    hf = _hf(tiny_qwen3_moe_dir)
    pool = random_prompts(hf.config.vocab_size)
    prompts = [[pool[0], pool[3]], [pool[6]]]
    ctx = mp.get_context("forkserver")
    results, done, barrier = ctx.Queue(), ctx.Event(), ctx.Barrier(2)
    address = free_tcp_address()
    procs = [ctx.Process(target=_eplb_rank, args=(r, 2, address, tiny_qwen3_moe_dir, prompts,
                                                  results, done, barrier), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    out = {}
    try:
        while len(out) < 2:
            rank, res = results.get(timeout=DEADLINE_S)
            out[rank] = res
        done.set()
        for p in procs:
            p.join(DEADLINE_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    r0, r1 = out[0]["report"], out[1]["report"]
    assert all(res["grouped"] and res["deferred_while_open"] for res in out.values())
    assert r0["applied"] and r0["balancedness_after"] > r0["balancedness_before"]
    for key in ("trigger", "balancedness_before", "balancedness_after", "experts_moved", "ranks"):
        assert r0[key] == r1[key], key  # one rebalance of the group, the same on both
    start, after = out[0]["start"], out[0]["after"]
    assert torch.equal(after.physical_to_logical, out[1]["after"].physical_to_logical)
    assert r0["ranks"] == 2 and r0["experts_moved"] == moves(start, after) > 0
    assert r0["received"] + r1["received"] > 0, "no expert crossed between the ranks"
    per_rank = after.num_physical // 2
    for rank, res in out.items():
        for row, layer in enumerate(_moe_layers(hf)):
            experts = hf.model.layers[layer].mlp.experts
            local = after.physical_to_logical[row, rank * per_rank:(rank + 1) * per_rank]
            for i, expert in enumerate(local.tolist()):
                assert torch.equal(res["slots"][row][0][i], experts.gate_up_proj[expert].detach())
                assert torch.equal(res["slots"][row][1][i], experts.down_proj[expert].detach())
        assert res["again"] == res["before"], f"rank {rank}: tokens changed by the rebalance"
        for prompt, ours in zip(prompts[rank], res["before"]):
            ref, gaps = hf_greedy(hf, prompt, 8)
            assert_greedy_equal(ours, ref, gaps, f"rank {rank} prompt {len(prompt)}")


def _moe_layers(hf) -> list[int]:
    return [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]


def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind, split", [("qwen3_moe", (3, 1)), ("mixtral", (2, 0))])
def test_ep2_greedy_equals_hf_on_every_rank(kind, split, request):
    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    hf = _hf(model_dir)
    pool = random_prompts(hf.config.vocab_size)
    prompts = [pool[:split[0]], pool[split[0]:split[0] + split[1]]]
    outs = _run_group(model_dir, prompts)
    for rank, mine in enumerate(prompts):
        assert len(outs[rank]) == len(mine)
        for prompt, ours in zip(mine, outs[rank]):
            ref, gaps = hf_greedy(hf, prompt, NEW_TOKENS)
            assert_greedy_equal(ours, ref, gaps, f"{kind} rank {rank} prompt {len(prompt)}")


def test_ep_options_are_checked_by_name(tiny_llama_dir, tiny_qwen3_moe_dir):
    from radixray import Engine
    with pytest.raises(ValueError, match="ep_init_method"):
        join_ep_group(EngineConfig.from_kwargs(model=tiny_qwen3_moe_dir, ep_size=2), 0, None)
    with pytest.raises(ValueError, match="ep_size"):
        EngineConfig.from_kwargs(model=tiny_qwen3_moe_dir, ep_size=0)
    with pytest.raises(ValueError, match="ep_size=2 needs a mixture-of-experts model"):
        Engine(model=tiny_llama_dir, dtype="float32", ep_size=2, ep_rank=0,
               ep_init_method="tcp://127.0.0.1:1")  # refused before joining any group
