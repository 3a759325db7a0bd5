"""Greedy tokens equal Hugging Face transformers' (fp32, same weights): alone, batched, chunked, cached."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import random_prompts, run_all_modes

BACKENDS = {
    "fused": {},  # C++ CPU kernels + cpu_paged attention (the default when they build)
    "torch": {"cpu_kernels": False, "attention_backend": "torch"},  # the pure-torch reference path
}


# Every family on the default (fused) path; the pure-torch path in the default run for
# Llama only (test_mixed_chunk runs it too), Qwen2 and Qwen3 on it in the slow run, for
# the 15-minute budget.
@pytest.mark.parametrize("kind, backend", [
    (kind, backend) if backend == "fused" or kind == "llama"
    else pytest.param(kind, backend, marks=pytest.mark.slow)
    for kind in ("llama", "qwen2", "qwen3") for backend in sorted(BACKENDS)])
def test_tiny_models_match_hf(kind, backend, request):
    from transformers import AutoModelForCausalLM
    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    run_all_modes(model_dir, random_prompts(hf.config.vocab_size), hf, f"{kind}/{backend}",
                  **BACKENDS[backend])


@pytest.mark.slow  # 80 s; the converted folder's greedy output is checked against
# transformers by tests/cpu/test_weight_update.py::test_default_model_takes_new_weights_by_every_path
def test_smollm2_gguf_matches_hf(smollm2_refs):
    prompts, refs = smollm2_refs
    run_all_modes("default", prompts, refs, "smollm2")
