"""MoE routing replay (radixray/rl/routing_replay.py) and the GRPO trainer that uses it.

The replay context on transformers' MoE models: the model's own routes give its plain
forward to the bit; forced routes give the hand-computed mixture of the forced experts
(router softmax gathered there), with gradient reaching the router and only the forced
experts; leaving the context restores the plain forward. Then a deterministic engine's
rollouts (every token's routes, cached prefix included) train a tiny Qwen3-MoE with replay
for several steps, the weights going back to the engine in between: the trainer's logprobs
equal the engine's exactly every step, and the scorer routed every token as the rollout did.
Against a bf16 engine (routes that flip between rollout and training), replay shrinks the
rollout-vs-train logprob difference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixray.rl.routing_replay import (
    MOE_BLOCK_CLASSES,
    RoutingReplay,
    batch_routes,
    moe_routers,
    pad_routes,
)


def _hf_model(kind: str):
    from model_fixtures import tiny_config
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(kind, 400), dtype=torch.float32).eval()


def _own_routes(model, tokens: torch.Tensor) -> torch.Tensor:
    """The model's own top-k ids ``[MoE layers, B, L, k]`` on ``tokens``."""
    seen = []
    handles = [r.register_forward_hook(lambda m, a, out: seen.append(out[2].clone()))
               for r in moe_routers(model)]
    with torch.no_grad():
        model(input_ids=tokens)
    for h in handles:
        h.remove()
    return torch.stack(seen).reshape(len(seen), *tokens.shape, -1)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_replaying_the_models_own_routes_is_its_plain_forward(kind):
    model = _hf_model(kind)
    tokens = torch.randint(1, 400, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(input_ids=tokens).logits
    routes = _own_routes(model, tokens)
    with torch.no_grad(), RoutingReplay(model, routes) as replay:
        replayed = model(input_ids=tokens).logits
    assert torch.equal(plain, replayed)
    assert replay.replayed == routes.shape[0] * 2 * 13 and replay.flips == 0


def _expert(experts, e: int, x: torch.Tensor) -> torch.Tensor:
    gate, up = (experts.gate_up_proj[e] @ x).chunk(2)
    return experts.down_proj[e] @ (F.silu(gate) * up)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_forced_routes_give_the_mixture_of_the_forced_experts(kind):
    """Each token goes to its two *least* likely experts (never its own top-2); the block's
    output is sum_j w_j * expert_j(x), w the router softmax at those ids (renormalised when
    the model renormalises), plus the shared expert where there is one. The router and the
    forced experts get gradient, the other experts none; leaving restores the plain block."""
    model = _hf_model(kind)
    block = next(m for m in model.modules() if type(m).__name__ in MOE_BLOCK_CLASSES)
    router, experts = block.gate, block.experts
    x = torch.randn(1, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = block(x)
        probs = torch.softmax(x[0] @ router.weight.T, dim=-1)
    forced = probs.argsort(dim=-1)[:, :router.top_k]  # [5, k], the least likely first
    with RoutingReplay(block, forced[None, None]) as replay:
        out = block(x)
        out.sum().backward()
    assert replay.replayed == 5 and replay.flips == 5
    renorm = getattr(model.config, "norm_topk_prob", True)
    with torch.no_grad():
        ref = torch.zeros_like(x[0])
        for t in range(5):
            w = probs[t, forced[t]]
            w = w / w.sum() if renorm else w
            ref[t] = sum(w[j] * _expert(experts, int(e), x[0, t]) for j, e in enumerate(forced[t]))
        if getattr(block, "shared_expert", None) is not None:
            ref += torch.sigmoid(block.shared_expert_gate(x[0])) * block.shared_expert(x[0])
    torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-6)
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    used = set(forced.flatten().tolist())
    grads = experts.gate_up_proj.grad.abs().sum(dim=(1, 2))
    assert {e for e in range(len(grads)) if grads[e] > 0} == used
    assert not router._forward_hooks
    with torch.no_grad():
        assert torch.equal(block(x), plain)


def test_routes_are_laid_out_like_the_padded_tokens():
    """Sample 0 covers positions 0..3 of its 5 tokens; sample 1 from position 2 (a prefix the
    engine did not cover) of its 4; sample 2 has none; -1 everywhere else."""
    samples = [
        {"prompt_ids": [1, 2], "output_ids": [3, 4, 5],
         "routed_experts": [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]},
        {"prompt_ids": [1, 2, 3], "output_ids": [4], "routed_experts": [[[1, 0]], [[3, 2]]],
         "routed_experts_start": 2},
        {"prompt_ids": [1, 2], "output_ids": [3]},
    ]
    routes = pad_routes(samples, 6, num_layers=1, top_k=2)
    assert routes.shape == (1, 3, 6, 2)
    assert routes[0, 0].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [-1, -1], [-1, -1]]
    assert routes[0, 1].tolist() == [[-1, -1], [-1, -1], [1, 0], [3, 2], [-1, -1], [-1, -1]]
    assert (routes[0, 2] == -1).all()
    with pytest.raises(ValueError, match="2 MoE layers"):
        pad_routes(samples, 6, num_layers=2, top_k=2)
    with pytest.raises(ValueError, match="the sequence has 4 tokens"):
        pad_routes([{**samples[1], "routed_experts_start": 3}], 6, num_layers=1, top_k=2)


def test_nothing_to_replay_on_a_dense_model_or_without_routes():
    dense = _hf_model("qwen3")
    moe = _hf_model("qwen3_moe")
    sample = {"prompt_ids": [1, 2], "output_ids": [3], "routed_experts": [[[0, 1]] * 2] * 2}
    assert batch_routes(dense, [sample], 3) is None
    assert batch_routes(moe, [{"prompt_ids": [1, 2], "output_ids": [3]}], 3) is None
    assert batch_routes(moe, [sample], 3).shape == (2, 1, 3, 2)
    with pytest.raises(ValueError, match="expert id 8"):
        batch_routes(moe, [{**sample, "routed_experts": [[[0, 8]] * 2] * 2}], 3)


def _rollout(eng, prompts: list[list[int]], seed: int) -> list[dict]:
    params = {"temperature": 1.0, "return_logprob": True, "return_unscaled_logprob": True,
              "ignore_eos": True, "max_new_tokens": 16, "return_routed_experts": True}
    outs = eng.generate(input_ids=prompts, sampling_params=[
        {**params, "seed": seed + i} for i in range(len(prompts))])
    return [{"prompt_ids": p, "output_ids": o["output_ids"],
             "logprobs": o["output_token_logprobs"], "advantage": (-1.0) ** i,
             "routed_experts": o["meta_info"]["routed_experts"],
             "routed_experts_start": o["meta_info"]["routed_experts_start"]}
            for i, (p, o) in enumerate(zip(prompts, outs))]


def test_deterministic_moe_training_with_replay_matches_the_engine_every_step(tiny_qwen3_moe_dir):
    """Three rollout -> train -> weight-update steps; two samples share a prompt, so one
    prefills it from the radix cache (its routes still cover it: enable_return_routed_experts)."""
    from radixray import Engine
    from radixray.rl.trainer import PolicyTrainer
    prompts = [[5, 9, 13, 21, 34], [5, 9, 13, 21, 34], [7, 7, 8], list(range(40, 80))]
    trainer = PolicyTrainer(tiny_qwen3_moe_dir, {"learning_rate": 1e-2, "clip_low": 0.2,
                                                 "clip_high": 0.2, "micro_batch_size": 2},
                            deterministic=True)
    scored = []  # the scorer's routes [T, MoE layers, k] per packed sequence
    trainer.scorer.model.register_forward_hook(lambda m, args, out: scored.extend(
        args[0].routed_experts.split(args[0].extend_lens)))
    before = {k: v.clone() for k, v in trainer.named_weights().items()}
    with Engine(model=tiny_qwen3_moe_dir, deterministic=True, max_total_tokens=8192,
                chunked_prefill_size=16, enable_return_routed_experts=True) as eng:
        for step in range(3):
            samples = _rollout(eng, prompts, seed=10 * step)
            scored.clear()
            stats = trainer.train_step(samples)
            assert stats["logprob_abs_diff_max"] == 0.0, (step, stats)
            assert stats["ratio_max"] == 1.0 and stats["grad_norm"] > 0
            assert "routing_flip_frac" in stats and stats["tokens"] == 64
            for s, routes in zip(samples, scored, strict=True):
                assert s["routed_experts_start"] == 0
                n = len(s["prompt_ids"]) + len(s["output_ids"]) - 1
                assert routes[:n].tolist() == s["routed_experts"], step
            eng.begin_weight_update()
            eng.update_weights_from_tensor(list(trainer.named_weights().items()))
            eng.end_weight_update(step + 1)
    moved = [k for k, v in trainer.named_weights().items() if not torch.equal(v, before[k])]
    assert any(".mlp.gate." in k for k in moved) and any(".mlp.experts." in k for k in moved)


def test_replay_shrinks_the_mismatch_of_a_bfloat16_rollout(tiny_qwen3_moe_dir):
    """A bf16 engine routes some tokens elsewhere than the fp32 trainer would (about 1% of
    the (token, MoE layer) routes here); replaying them takes the largest logprob
    differences away (measured here: max 0.045 with replay vs 0.35 without, mean 0.015 vs
    0.028; the rest is bf16 vs fp32 rounding)."""
    from radixray import Engine
    from radixray.rl.trainer import PolicyTrainer
    prompts = [list(range(3 + 7 * i, 40 + 5 * i)) for i in range(8)]
    with Engine(model=tiny_qwen3_moe_dir, dtype="bfloat16", max_total_tokens=8192,
                enable_return_routed_experts=True) as eng:
        samples = _rollout(eng, prompts, seed=3)
    opts = {"learning_rate": 1e-2, "clip_low": 0.2, "clip_high": 0.2, "micro_batch_size": 4}
    replay = PolicyTrainer(tiny_qwen3_moe_dir, opts).train_step(samples)
    plain = PolicyTrainer(tiny_qwen3_moe_dir, {**opts, "routing_replay": False}).train_step(samples)
    assert replay["routing_flip_frac"] > 0 and "routing_flip_frac" not in plain
    assert replay["logprob_abs_diff_max"] < plain["logprob_abs_diff_max"]
    assert replay["logprob_abs_diff_mean"] < plain["logprob_abs_diff_mean"]


def test_grpo_config_asks_a_moe_fleet_for_whole_sequence_routes(tiny_qwen3_moe_dir, tiny_llama_dir):
    from radixray.rl.config import GRPOConfig

    def engine_flag(**data):
        return GRPOConfig.parse(data).fleet.engine.enable_return_routed_experts
    assert engine_flag(model=tiny_qwen3_moe_dir) is True
    assert engine_flag(model=tiny_qwen3_moe_dir, routing_replay=False) is False
    assert engine_flag(model=tiny_llama_dir) is False
    assert engine_flag(model=tiny_qwen3_moe_dir,
                       fleet={"engine": {"enable_return_routed_experts": False}}) is False
