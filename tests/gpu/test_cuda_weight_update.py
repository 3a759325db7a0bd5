"""Weight updates and memory release with the engine on a CUDA device (skipped without one)."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import random_prompts
from weight_helpers import assert_matches_hf, perturb

pytestmark = pytest.mark.gpu


def test_tensor_update_and_memory_release_on_cuda(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    from radixray import Engine
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).to("cuda").eval()
    prompts = random_prompts(hf.config.vocab_size)[2:5]
    with Engine(model=tiny_qwen3_dir, device="cuda", dtype="float32", max_total_tokens=4096,
                check_kv_conservation=True) as eng:
        named = perturb(hf, seed=31)
        eng.begin_weight_update()
        eng.update_weights_from_tensor(named)  # CUDA tensors staged on the engine's device
        eng.end_weight_update(1)
        assert_matches_hf(eng, hf, prompts, 16, "cuda tensor update", version=1)
        before = torch.cuda.memory_allocated()
        eng.pause_generation("retract")
        eng.release_memory_occupation(["kv_cache", "weights"])
        assert torch.cuda.memory_allocated() < before
        eng.resume_memory_occupation()
        eng.continue_generation()
        assert_matches_hf(eng, hf, prompts, 16, "cuda after release/resume", version=1)
        eng.check_kv_conservation()
