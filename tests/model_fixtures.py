"""Tiny random-weight models and tokenizers built locally for tests (nothing is downloaded)."""

from __future__ import annotations

import os
import random
from functools import lru_cache

import torch

TINY_CORPUS = (["Hello world, this is a test. The quick brown fox jumps over the lazy dog."] * 20
               + ["Café crème é", "中文 测试", "emoji 🙂 smile", "stop here STOP now <end>"] * 2)


@lru_cache(maxsize=1)
def byte_bpe_tokenizer():
    """A small byte-level BPE tokenizer trained in memory: multi-byte characters split into byte tokens."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TINY_CORPUS, vocab_size=400, min_frequency=2,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


# A plain-text chat format, so chat endpoints can be tested on the tiny models.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def tiny_config(kind: str, vocab_size: int):
    """Small but non-trivial shapes: GQA, several layers; Qwen3 with head_dim != hidden/heads;
    the mixture-of-experts kinds route each token to 2 of 8 experts."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=160,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.15,
                  eos_token_id=0, bos_token_id=None, pad_token_id=None)
    if kind == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if kind == "qwen3":
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if kind == "qwen2":  # q/k/v projections carry biases
        return Qwen2Config(**common, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if kind == "qwen3_moe":  # renormalized top-2 of 8; layer 1 dense (mlp_only_layers)
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(**common, **moe, head_dim=32, norm_topk_prob=True,
                              mlp_only_layers=[1], tie_word_embeddings=False)
    if kind == "qwen2_moe":  # top-2 of 8 not renormalized, plus a sigmoid-gated shared expert
        from transformers import Qwen2MoeConfig
        return Qwen2MoeConfig(**common, **moe, norm_topk_prob=False,
                              shared_expert_intermediate_size=48, tie_word_embeddings=True)
    if kind == "mixtral":  # top-2 of 8, every layer sparse
        from transformers import MixtralConfig
        return MixtralConfig(**{**common, "intermediate_size": 32}, num_local_experts=8,
                             num_experts_per_tok=2, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    raise ValueError(kind)


def build_tiny_model(kind: str, folder: str, seed: int = 0) -> str:
    """Save a random-weight ``kind`` model (safetensors) plus the tiny tokenizer into ``folder``."""
    from transformers import AutoModelForCausalLM

    tok = byte_bpe_tokenizer()
    config = tiny_config(kind, len(tok))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens from a Hugging Face model with its KV cache, never stopping early.

    Also returns, per step, the gap between the top-2 logits (to recognise near-ties).
    """
    device = model.device
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids], device=device)
        out = model(input_ids=ids, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1].float()
        tokens, gaps = [], []
        for _ in range(max_new_tokens):
            top2 = torch.topk(logits, 2).values
            gaps.append(float(top2[0] - top2[1]))
            nxt = int(logits.argmax())
            tokens.append(nxt)
            out = model(input_ids=torch.tensor([[nxt]], device=device), past_key_values=past,
                        use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1].float()
    return tokens, gaps


NEAR_TIE = 1e-4


def assert_greedy_equal(ours: list[int], ref: list[int], gaps: list[float], label: str) -> None:
    """Equal tokens, except a divergence at a documented near-tie (top-2 gap < 1e-4), which is printed."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            if gaps[i] < NEAR_TIE:
                print(f"[near-tie] {label}: step {i} ours={a} hf={b} top-2 gap={gaps[i]:.2e}; "
                      "sequences diverge after it, comparison stops")
                return
            raise AssertionError(f"{label}: token {i} differs: ours {a} vs HF {b} "
                                 f"(top-2 gap {gaps[i]:.3e})\nours={ours}\nhf  ={ref}")
    assert len(ours) == len(ref), f"{label}: {len(ours)} tokens vs HF {len(ref)}"


# Prompts for the default model (SmolLM2): prose, code, chat markup.
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


NEW_TOKENS = 32


def random_prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    """Eight prompts of 3-70 tokens (several cross a 16-token chunk); two share a 20-token prefix."""
    rng = random.Random(seed)
    lengths = [3, 7, 12, 17, 25, 33, 48, 70]
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]
    prompts[5][:20] = prompts[6][:20]
    return prompts


def run_all_modes(model_dir: str, prompts: list[list[int]], hf_model, label: str,
                  alone: tuple[int, ...] | None = None, **engine_options) -> None:
    """fp32 greedy tokens equal ``hf_model``'s for each prompt alone, batched, from the radix
    cache and with 16-token chunked prefill; KV conservation holds after each engine.

    ``hf_model``: the Hugging Face model, or its references already computed (``hf_greedy``
    of each prompt, as :func:`smollm2_references` gives them). ``alone``: the indices of the
    prompts also run one at a time (all when None); a tensor-parallel group of more ranks
    than this machine's two CPUs takes ~0.25 s a decode step, so its tests run two alone and
    leave the rest to the batch."""
    from radixray import Engine

    refs = hf_model if isinstance(hf_model, list) else [
        hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    greedy = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}

    def check(outs, mode):
        for i, (out, (ref, gaps)) in enumerate(zip(outs, refs)):
            assert_greedy_equal(out["output_ids"], ref, gaps, f"{label} {mode} prompt {i}")

    with Engine(model=model_dir, dtype="float32", max_total_tokens=8192,
                check_kv_conservation=True, **engine_options) as eng:
        picks = range(len(prompts)) if alone is None else alone
        for i in picks:
            out = eng.generate(input_ids=prompts[i], sampling_params=greedy)
            assert_greedy_equal(out["output_ids"], *refs[i], f"{label} alone prompt {i}")
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


def smollm2_references() -> tuple[list[list[int]], list[tuple[list[int], list[float]]]]:
    """The default model's (SmolLM2 GGUF) ``SMOL_PROMPTS`` as token ids, and transformers'
    greedy tokens and top-2 gaps for each (loading and running it takes ~40 s here: the
    session fixture ``smollm2_refs`` computes them once)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from radixray.engine.weights.loader import default_model_path
    folder, name = default_model_path().rsplit("/", 1)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    prompts = [tok.encode(p) for p in SMOL_PROMPTS]
    return prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


# ---- LoRA adapters (tests/cpu/test_lora.py, test_lora_serving.py) ------------------------
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, rsLoRA, seed)
LORA_ADAPTERS = {"alpha": (4, 8, False, 11), "beta": (8, 16, True, 12)}


def make_lora_adapter(base_dir: str, folder: str, rank: int, alpha: int, rslora: bool,
                      seed: int) -> str:
    """A PEFT adapter on every projection of ``base_dir``'s model, with random non-zero A
    and B (PEFT starts B at zero), saved to ``folder``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=LORA_MODULES, use_rslora=rslora,
                     lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    peft_model.save_pretrained(folder)
    return folder


def make_lora_adapters(base_dir: str, root: str) -> dict[str, str]:
    """``LORA_ADAPTERS`` made under ``root``: name -> folder."""
    return {name: make_lora_adapter(base_dir, os.path.join(root, name), *spec)
            for name, spec in LORA_ADAPTERS.items()}


def merged_hf(base_dir: str, adapter_dir: str | None):
    """The Hugging Face model of ``base_dir`` with the adapter merged into its weights
    (peft's merge_and_unload), fp32; the plain model without an adapter."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return model
    from peft import PeftModel
    return PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()
