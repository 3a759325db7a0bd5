"""The engine on a CUDA device (skipped without one).

fp32 greedy tokens equal Hugging Face's on the same GPU in every mode (alone, batched,
radix-cache hit, chunked prefill), with the attention backend ``auto`` picks there (triton
when it is installed, else torch); bf16 (what ``dtype=auto`` picks on a GPU) serves
greedy, seeded and penalised sampling with its pool and logits on the device, and every
KV slot is accounted for afterwards.
"""

from __future__ import annotations

import pytest
import torch
from model_fixtures import random_prompts, run_all_modes

pytestmark = pytest.mark.gpu


def _triton_installed() -> bool:
    """What the auto attention backend looks at on CUDA: triton when it imports."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_hf_on_cuda(kind, request):
    from transformers import AutoModelForCausalLM
    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda").eval()
    run_all_modes(model_dir, random_prompts(hf.config.vocab_size), hf, f"{kind}/cuda",
                  device="cuda")


def test_bf16_auto_on_cuda_samples_and_accounts(tiny_llama_dir):
    from radixray import Engine
    prompts = random_prompts(300)
    with Engine(model=tiny_llama_dir, device="cuda", max_total_tokens=4096,
                check_kv_conservation=True) as eng:
        runner = eng.runner
        assert runner.dtype == torch.bfloat16  # auto on a GPU
        assert runner.kv_pool.k_buffers[0].is_cuda
        assert runner.attn_backend.name == ("triton" if _triton_installed() else "torch")
        greedy = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
        alone = [eng.generate(input_ids=p, sampling_params=greedy)["output_ids"] for p in prompts]
        assert all(len(ids) == 16 for ids in alone)
        seeded = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 7, "max_new_tokens": 16,
                  "ignore_eos": True, "frequency_penalty": 0.5, "presence_penalty": 0.3}
        first = eng.generate(input_ids=prompts, sampling_params=seeded)
        again = eng.generate(input_ids=prompts, sampling_params=seeded)
        assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again]
        with_logprobs = eng.generate(input_ids=prompts[0], sampling_params={
            **greedy, "return_logprob": True, "top_logprobs_num": 2})
        assert with_logprobs["output_ids"] == alone[0]
        assert len(with_logprobs["output_token_logprobs"]) == 16
        assert all(len(top) == 2 for top in with_logprobs["output_top_logprobs"])
        eng.flush_cache()
        eng.check_kv_conservation()
