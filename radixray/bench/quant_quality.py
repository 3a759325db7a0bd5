"""``radixray bench quant-quality``: what ``quantization="w8a8_int8"`` costs in output quality.

Two measurements on the same weights:

- **Perplexity** of a text file (teacher-forced, first ``--max-tokens`` tokens)
  under the Hugging Face model as loaded, and under the same model with every
  linear but the lm_head running the engine's int8 arithmetic
  (``Int8ReferenceLinear``; tests check the engine matches it); with
  ``--quantize-lm-head`` the lm_head as well.
- **Greedy agreement**: chat prompts answered by two radixray Engines, unquantized
  and w8a8_int8 (with ``--kv-cache-dtype``, that engine's KV pool narrowed too, which
  the perplexity above does not see); for each prompt, how many leading tokens are
  identical.

Prints a table and, with ``--output-json``, writes the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

from radixray.bench import add_engine_arguments

CHAT_PROMPTS = (
    "What is the capital of France?", "Write a Python function that reverses a string.",
    "Explain photosynthesis in two sentences.", "List three primary colors.",
    "Translate to French: Good morning, how are you?", "What is 12 times 7?",
    "Give me a haiku about the sea.", "Why is the sky blue?",
    "Name three planets of the solar system.", "How do I boil an egg?",
)


def load_hf_model(model: str):
    """(tokenizer, fp32 model) from transformers, resolved as the engine resolves ``model``
    (a GGUF is converted once, like for the naive server)."""
    import torch
    from transformers import AutoModelForCausalLM

    from radixray.engine.weights.loader import resolve_model
    src = resolve_model(model)
    return src.tokenizer, AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32).eval()


def perplexities(model: str, text: str, max_tokens: int, lm_head: bool = False) -> dict:
    import torch

    from radixray.kernels.int8_linear import Int8ReferenceLinear, replace_linears
    tok, hf = load_hf_model(model)
    ids = tok(text, return_tensors="pt").input_ids[:, :max_tokens]
    with torch.inference_mode():
        base = math.exp(hf(ids, labels=ids).loss.item())
        replace_linears(hf, Int8ReferenceLinear, skip=() if lm_head else ("lm_head",))
        quant = math.exp(hf(ids, labels=ids).loss.item())
    return {"tokens": int(ids.shape[1]), "perplexity": base, "perplexity_w8a8_int8": quant}


def greedy_agreement(model: str, max_new_tokens: int, lm_head: bool = False,
                     kv_cache_dtype: str = "auto") -> list[dict]:
    from radixray import Engine
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    outputs = {}
    for quant in (None, "w8a8_int8"):
        with Engine(model=model, quantization=quant, quantize_lm_head=lm_head and quant is not None,
                    kv_cache_dtype=kv_cache_dtype if quant else "auto", max_total_tokens=8192) as eng:
            ids = [eng.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
            outputs[quant] = eng.generate(input_ids=ids, sampling_params=params)
    rows = []
    for prompt, a, b in zip(CHAT_PROMPTS, outputs[None], outputs["w8a8_int8"]):
        x, y = a["output_ids"], b["output_ids"]
        same = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        rows.append({"prompt": prompt, "identical_prefix": same, "tokens": len(x),
                     "tokens_w8a8_int8": len(y), "text": a["text"], "text_w8a8_int8": b["text"]})
    return rows


def run_cli(args) -> int:
    with open(args.text_file, encoding="utf-8") as f:
        text = f.read()
    ppl = perplexities(args.model, text, args.max_tokens, args.quantize_lm_head)
    rows = greedy_agreement(args.model, args.max_new_tokens, args.quantize_lm_head, args.kv_cache_dtype)
    change = 100 * (ppl["perplexity_w8a8_int8"] / ppl["perplexity"] - 1)
    print(f"perplexity over {ppl['tokens']} tokens of {args.text_file}: "
          f"{ppl['perplexity']:.3f} unquantized, {ppl['perplexity_w8a8_int8']:.3f} w8a8_int8 ({change:+.2f}%)")
    print(f"{'identical':>9} {'tokens':>6}  prompt")
    for r in rows:
        print(f"{r['identical_prefix']:>9} {r['tokens']:>6}  {r['prompt']}")
    prefixes = [r["identical_prefix"] for r in rows]
    whole = sum(r["identical_prefix"] == r["tokens"] == r["tokens_w8a8_int8"] for r in rows)
    print(f"greedy answers identical to the end: {whole} of {len(rows)}; "
          f"median identical prefix {statistics.median(prefixes)} tokens")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": args.model, "text_file": args.text_file, "quantize_lm_head": args.quantize_lm_head,
                       "kv_cache_dtype": args.kv_cache_dtype, **ppl, "greedy": rows}, f, indent=1)
    return 0


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Add the ``quant-quality`` subcommand; its ``func`` is :func:`run_cli`."""
    p = bench_subparsers.add_parser(
        "quant-quality", help="perplexity and greedy agreement of w8a8_int8 against the unquantized model",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # quantize_lm_head and kv_cache_dtype apply to the quantized engine of the comparison
    add_engine_arguments(p, ("model", "quantize_lm_head", "kv_cache_dtype"))
    p.add_argument("--text-file", default="README.md", help="text whose perplexity is measured")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens of the text used")
    p.add_argument("--max-new-tokens", type=int, default=64, help="greedy tokens per chat prompt")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run_cli)
    return p
