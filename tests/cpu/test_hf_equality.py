"""Greedy tokens equal Hugging Face transformers' (fp32, same weights): alone, batched, chunked, cached."""

from __future__ import annotations

import random

import pytest
import torch
from model_fixtures import assert_greedy_equal, hf_greedy

from radixray import Engine

NEW_TOKENS = 32


def random_prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 7, 12, 17, 25, 33, 48, 70]  # several cross the 16-token chunk
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]
    prompts[5][:20] = prompts[6][:20]  # two prompts share a 20-token prefix
    return prompts


def run_all_modes(model_dir: str, prompts: list[list[int]], hf_model, label: str,
                  **engine_options) -> None:
    refs = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    greedy = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}

    def check(outs, mode):
        for i, (out, (ref, gaps)) in enumerate(zip(outs, refs)):
            assert_greedy_equal(out["output_ids"], ref, gaps, f"{label} {mode} prompt {i}")

    with Engine(model=model_dir, dtype="float32", max_total_tokens=8192,
                check_kv_conservation=True, **engine_options) as eng:
        check([eng.generate(input_ids=p, sampling_params=greedy) for p in prompts], "alone")
        eng.flush_cache()
        check(eng.generate(input_ids=prompts, sampling_params=greedy), "batch")
        cached = eng.generate(input_ids=prompts, sampling_params=greedy)
        check(cached, "radix-cache hit")
        for p, out in zip(prompts, cached):
            assert out["meta_info"]["cached_tokens"] == len(p) - 1
        eng.check_kv_conservation()
    with Engine(model=model_dir, dtype="float32", max_total_tokens=8192, chunked_prefill_size=16,
                check_kv_conservation=True, **engine_options) as eng:
        check(eng.generate(input_ids=prompts, sampling_params=greedy), "chunked-16")
        eng.check_kv_conservation()


BACKENDS = {
    "fused": {},  # C++ CPU kernels + cpu_paged attention (the default when they build)
    "torch": {"cpu_kernels": False, "attention_backend": "torch"},  # the pure-torch reference path
}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_hf(kind, backend, request):
    from transformers import AutoModelForCausalLM
    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    run_all_modes(model_dir, random_prompts(hf.config.vocab_size), hf, f"{kind}/{backend}",
                  **BACKENDS[backend])


SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
    "Translate to French: Good morning, how are you?",
    "The quick brown fox",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at a temperature of",
]


def test_smollm2_gguf_matches_hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from radixray.engine.loader import default_model_path
    path = default_model_path()
    folder, name = path.rsplit("/", 1)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    prompts = [tok.encode(p) for p in SMOL_PROMPTS]
    run_all_modes("default", prompts, hf, "smollm2")
