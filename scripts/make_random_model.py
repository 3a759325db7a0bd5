"""Build a random-weight Hugging Face model folder (safetensors, config, tokenizer) locally,
for benchmarks and checks on machines without internet.

    python scripts/make_random_model.py --shape llama-1b --out /tmp/llama-1b
    python scripts/make_random_model.py --shape tiny --out /tmp/tiny

``llama-1b`` has Llama-3.2-1B's shapes (hidden 2048, 16 layers, 32 query / 8 KV heads,
intermediate 8192, vocab 128256, tied embeddings, llama3 rope) in bf16: the same bytes per
decode step as the real model, random weights. ``tiny`` is a two-layer fp32 Llama for quick
checks. The tokenizer is the tests' small byte-level BPE (tests/model_fixtures.py); it knows
fewer ids than the model's vocabulary, so text is only meaningful for ids below its size
(decoding skips the others): benchmarks feed token ids.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

SHAPES = {
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
                     tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                     initializer_range=0.02, dtype="bfloat16"),
    # vocab above the tokenizer's size on purpose: the same id/tokenizer mismatch as llama-1b
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 rope_theta=10000.0, rope_scaling=None, initializer_range=0.1,
                 dtype="float32"),
}


def tokenizer():
    """The tests' byte-level BPE tokenizer, trained in memory (nothing downloaded)."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from model_fixtures import byte_bpe_tokenizer
    return byte_bpe_tokenizer()


@contextlib.contextmanager
def default_dtype(dtype):
    import torch
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


MARKER = ".random-model.json"  # written last: the folder is complete


def existing(shape: str, out: str, seed: int) -> dict | None:
    """The summary of a complete earlier build of the same shape and seed in ``out``."""
    try:
        with open(os.path.join(out, MARKER)) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None
    return summary if (summary.get("shape"), summary.get("seed")) == (shape, seed) else None


def build(shape: str, out: str, device: str = "auto", seed: int = 0) -> dict:
    """Save a random ``shape`` Llama plus the tokenizer into ``out``; returns a summary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(out, MARKER)):
        os.remove(os.path.join(out, MARKER))
    spec = dict(SHAPES[shape])
    dtype = getattr(torch, spec.pop("dtype"))
    if spec["rope_scaling"] is None:
        del spec["rope_scaling"]
    tok = tokenizer()
    # legacy rope_theta/rope_scaling kwargs: transformers 4.x takes them as they are and 5.x
    # converts them to rope_parameters
    config = LlamaConfig(**spec, eos_token_id=tok.eos_token_id, bos_token_id=None,
                         pad_token_id=None)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    with default_dtype(dtype), torch.device(device):  # random init on the GPU when there is one
        model = LlamaForCausalLM(config)
    model = model.to(dtype).eval()
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    summary = {"shape": shape, "seed": seed, "out": out, "params": params,
               "dtype": str(dtype).removeprefix("torch."), "device": device,
               "seconds": round(time.perf_counter() - t0, 1), "tokenizer_size": len(tok)}
    del model
    with open(os.path.join(out, MARKER), "w") as f:
        json.dump(summary, f)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--out", required=True, help="folder to write (created)")
    p.add_argument("--device", default="auto", help="where to initialise the weights "
                   "(auto: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reuse", action="store_true", help="keep a complete earlier build of the "
                   "same shape and seed in --out instead of building again")
    args = p.parse_args(argv)
    summary = existing(args.shape, args.out, args.seed) if args.reuse else None
    if summary is not None:
        print(json.dumps({**summary, "reused": True}))
        return 0
    print(json.dumps(build(args.shape, args.out, args.device, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
