"""Deterministic mode: batch-invariant engine, and a trainer forward equal to it to the bit.

One prompt sent 50 times among random neighbours, under several prefill chunk sizes,
with cached and uncached prefixes, gives one output and one list of logprobs; the
trainer's logprobs of a rollout equal the engine's exactly, before and after the trainer's
weights reach the engine. Without deterministic mode the 50-times test sees several
distinct outputs (the fp32 BLAS and attention paths change with the batch shape).
"""

from __future__ import annotations

import random

import pytest
import torch

from radixray import Engine
from radixray.engine.config import EngineConfig
from radixray.engine.executor.sampler import Sampler
from radixray.engine.sampling import SamplingParams

SAMPLED = {"temperature": 1.0, "return_logprob": True, "return_unscaled_logprob": True,
           "ignore_eos": True}


def _engine(model_dir: str, **over) -> Engine:
    options = {"max_total_tokens": 8192, "check_kv_conservation": True, **over}
    return Engine(model=model_dir, deterministic=True, **options)


def test_one_prompt_fifty_times_gives_one_output(tiny_llama_dir):
    """Random batch neighbours (some sharing the prompt's prefix, so in-batch and radix-cache
    prefixes too), random positions in the batch, prefill chunks of 5 and 16 tokens and
    none, no seed given (deterministic mode seeds a sampled request with 42)."""
    rng = random.Random(0)
    prompt = [rng.randrange(1, 350) for _ in range(45)]
    seen: set[tuple] = set()
    trials = 0
    for chunk in (-1, 5, 16):
        with _engine(tiny_llama_dir, chunked_prefill_size=chunk) as eng:
            for _ in range(18 if chunk == -1 else 16):
                others = []
                for _ in range(rng.randrange(0, 9)):
                    shared = prompt[:rng.randrange(0, 40)] if rng.random() < 0.4 else []
                    others.append(shared + [rng.randrange(1, 350)
                                            for _ in range(rng.randrange(1, 60))])
                at = rng.randrange(0, len(others) + 1)
                batch = others[:at] + [prompt] + others[at:]
                params = [{**SAMPLED, "max_new_tokens": rng.randrange(1, 30), "seed": i}
                          for i in range(len(batch))]
                params[at] = {**SAMPLED, "max_new_tokens": 24}
                out = eng.generate(input_ids=batch, sampling_params=params)[at]
                seen.add((tuple(out["output_ids"]), tuple(out["output_token_logprobs"])))
                trials += 1
            eng.check_kv_conservation()
    assert trials == 50
    assert len(seen) == 1, f"{len(seen)} distinct outputs for one prompt"


def _rollout(eng: Engine, prompts: list[list[int]], new_tokens: int, seed: int) -> list[dict]:
    outs = eng.generate(input_ids=prompts, sampling_params=[
        {**SAMPLED, "max_new_tokens": new_tokens, "seed": seed + i} for i in range(len(prompts))])
    return [{"prompt_ids": p, "output_ids": o["output_ids"],
             "logprobs": o["output_token_logprobs"], "advantage": (-1.0) ** i}
            for i, (p, o) in enumerate(zip(prompts, outs))]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2"])
def test_trainer_logprobs_equal_the_engines_across_weight_updates(kind, tmp_path_factory):
    """Step 0 on the loaded weights, then the trainer's new weights go to the engine (as a
    colocated or separate sync delivers them: fp32 tensors by name) and step 1 scores the
    next rollout: the difference is 0.0 both times, and the weights did move."""
    from model_fixtures import build_tiny_model

    from radixray.rl.trainer import PolicyTrainer
    model_dir = build_tiny_model(kind, str(tmp_path_factory.mktemp(f"det-{kind}")))
    prompts = [[5, 9, 13, 21, 34], [7, 7, 8], list(range(40, 80))]
    trainer = PolicyTrainer(model_dir, {"learning_rate": 1e-2, "clip_low": 0.2, "clip_high": 0.2,
                                        "micro_batch_size": 2}, deterministic=True)
    with _engine(model_dir, chunked_prefill_size=16) as eng:
        first = trainer.train_step(_rollout(eng, prompts, 20, seed=1))
        eng.begin_weight_update()
        eng.update_weights_from_tensor(list(trainer.named_weights().items()))
        eng.end_weight_update(1)
        second = trainer.train_step(_rollout(eng, prompts, 20, seed=1))
    for stats in (first, second):
        assert stats["tokens"] == 60
        assert stats["logprob_abs_diff_max"] == 0.0 and stats["logprob_abs_diff_mean"] == 0.0
        assert stats["ratio_max"] == 1.0 and stats["grad_norm"] > 0


@pytest.mark.slow  # out of the default run's 15-minute budget: make test-slow
def test_default_model_trainer_logprobs_equal_the_engines():
    """SmolLM2-135M-Instruct (the default model), one rollout of two prompts."""
    from radixray.engine.weights.loader import resolve_model
    from radixray.rl.trainer import PolicyTrainer
    source = resolve_model("default")
    tok = source.tokenizer
    prompts = [tok.encode("What is 17 + 25? Answer:"), tok.encode("Count the letter r in 'rare':")]
    with _engine("default", max_total_tokens=2048) as eng:
        samples = _rollout(eng, prompts, 12, seed=7)
    trainer = PolicyTrainer(source.path, {"learning_rate": 1e-6, "clip_low": 0.2,
                                          "clip_high": 0.2, "micro_batch_size": 2},
                            deterministic=True)
    stats = trainer.train_step(samples)
    assert stats["tokens"] == 24 and stats["logprob_abs_diff_max"] == 0.0


def test_logprobs_of_a_row_ignore_the_other_rows_temperatures():
    """A temperature-1 row's logprobs come from its raw logits even when another row of the
    batch needs temperature scaling (which shifts its logits first)."""
    sampler = Sampler(vocab_size=50)
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0)) * 4
    mine = SamplingParams(temperature=1.0, return_logprob=True, seed=1)
    alone = sampler.sample(logits[:1], [mine], [torch.Generator().manual_seed(1)], [[]])
    other = SamplingParams(temperature=0.3, return_logprob=True, seed=2)
    both = sampler.sample(logits, [mine, other], [torch.Generator().manual_seed(1),
                                                  torch.Generator().manual_seed(2)], [[], []])
    assert both.token_ids[0] == alone.token_ids[0]
    assert both.logprobs[0] == alone.logprobs[0]


@pytest.mark.parametrize("over, field", [
    ({"quantization": "w8a8_int8"}, "quantization"),
    ({"kv_cache_dtype": "bfloat16"}, "kv_cache_dtype"),
    ({"dtype": "bfloat16"}, "dtype"),
    ({"attention_backend": "torch"}, "attention_backend"),
    ({"cpu_kernels": False}, "cpu_kernels"),
])
def test_deterministic_refuses_options_without_batch_invariant_kernels(over, field):
    with pytest.raises(ValueError, match=f"deterministic=true needs {field} in"):
        EngineConfig(deterministic=True, **over)
