"""``radixray bench default-quality``: what the default precision costs against ``--exact``.

Both sides are radixray Engines on the same model, the default configuration as a new user
gets it on this machine (engine/precision.py: on CPUs with the int8 kernels, int8 weights
and activations, int8 lm_head, fp8_e5m2 KV) and ``exact=true``:

- **perplexity** of the first ``max_tokens`` tokens of a text, from the engine's own prompt
  logprobs (teacher-forced through its real kernels and KV pool, so the fp8 cache counts);
- **greedy agreement** on 32 chat prompts: for each, how many leading tokens are identical
  and whether the whole answer is.

``check_bounds`` states the bounds tests/cpu/test_default_precision.py holds the default to.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

from radixray.bench import add_engine_arguments

PROMPTS = (
    "What is the capital of France?", "Write a Python function that reverses a string.",
    "Explain photosynthesis in two sentences.", "List three primary colors.",
    "Translate to French: Good morning, how are you?", "What is 12 times 7?",
    "Give me a haiku about the sea.", "Why is the sky blue?",
    "Name three planets of the solar system.", "How do I boil an egg?",
    "What does a CPU do?", "Suggest a name for a black cat.",
    "What is the boiling point of water in Celsius?", "Write one sentence about autumn.",
    "How many legs does a spider have?", "What is the opposite of 'ancient'?",
    "Give two tips for sleeping better.", "Who wrote Romeo and Juliet?",
    "What is a prime number?", "Describe a rainbow to a child.",
    "What is 15 plus 27?", "Name a fruit that is yellow.",
    "Why do we need water?", "Write a short greeting for a birthday card.",
    "What is the largest ocean on Earth?", "How do plants drink water?",
    "What is the plural of 'mouse'?", "Give an example of a mammal that can fly.",
    "What language is spoken in Brazil?", "Explain what a verb is.",
    "What color do you get by mixing blue and yellow?", "Recommend a book for a beginner "
    "programmer.",
)

# The default may cost at most this much (tests/cpu/test_default_precision.py): README
# perplexity at most 15% above exact's, and the first 8 tokens identical in at least a
# third of the answers. Measured on SmolLM2-135M (docs/quantization.md): +10.8% and 50%.
MAX_PERPLEXITY_RATIO = 1.15
MIN_SHARE_8_TOKENS_IDENTICAL = 1 / 3


def engine_perplexity(engine, ids: list[int]) -> float:
    """exp of the mean negative logprob of ``ids[1:]`` given their prefixes, by ``engine``."""
    out = engine.generate(input_ids=ids, sampling_params={
        "max_new_tokens": 1, "return_logprob": True, "logprob_start_len": 0})
    logprobs = out["input_token_logprobs"][1:]  # the first token has none
    return math.exp(-sum(logprobs) / len(logprobs))


def measure(model: str, text: str, max_tokens: int, max_new_tokens: int,
            prompts: tuple[str, ...] = PROMPTS, bundle: bool = False) -> dict:
    """Perplexity and greedy answers of the default engine and the exact one (their
    precision log lines included); ``bundle``: the fast CPU bundle on the default side
    whatever this CPU's default is."""
    from radixray import Engine
    from radixray.engine.precision import FAST_DEFAULT
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    sides = {}
    for name, options in (("default", FAST_DEFAULT if bundle else {}), ("exact", {"exact": True})):
        with Engine(model=model, max_total_tokens=8192, **options) as engine:
            ids = engine.tokenizer(text)["input_ids"][:max_tokens]
            chats = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
            sides[name] = {"precision": engine.model_facts().precision,
                           "perplexity": engine_perplexity(engine, ids),
                           "answers": engine.generate(input_ids=chats, sampling_params=params)}
    rows = []
    for prompt, a, b in zip(prompts, sides["exact"]["answers"], sides["default"]["answers"]):
        x, y = a["output_ids"], b["output_ids"]
        same = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        rows.append({"prompt": prompt, "identical_prefix": same, "whole": x == y,
                     "text_exact": a["text"], "text_default": b["text"]})
    return {"model": model, "tokens": len(ids), "max_new_tokens": max_new_tokens,
            "precision_default": sides["default"]["precision"],
            "perplexity_exact": sides["exact"]["perplexity"],
            "perplexity_default": sides["default"]["perplexity"],
            "perplexity_ratio": sides["default"]["perplexity"] / sides["exact"]["perplexity"],
            "answers_identical": sum(r["whole"] for r in rows),
            "share_8_tokens_identical": sum(r["identical_prefix"] >= min(8, max_new_tokens)
                                            for r in rows) / len(rows),
            "median_identical_prefix": statistics.median(r["identical_prefix"] for r in rows),
            "prompts": rows}


def check_bounds(result: dict) -> list[str]:
    """The bounds ``result`` breaks (empty: within them)."""
    broken = []
    if result["perplexity_ratio"] > MAX_PERPLEXITY_RATIO:
        broken.append(f"perplexity ratio {result['perplexity_ratio']:.4f} > {MAX_PERPLEXITY_RATIO}")
    if result["share_8_tokens_identical"] < MIN_SHARE_8_TOKENS_IDENTICAL:
        broken.append(f"share with 8 identical leading tokens {result['share_8_tokens_identical']:.2f}"
                      f" < {MIN_SHARE_8_TOKENS_IDENTICAL}")
    return broken


def run_cli(args) -> int:
    with open(args.text_file, encoding="utf-8") as f:
        text = f.read()
    r = measure(args.model, text, args.max_tokens, args.max_new_tokens, bundle=args.bundle)
    print(f"default: {r['precision_default']}")
    print(f"perplexity over {r['tokens']} tokens of {args.text_file}: exact "
          f"{r['perplexity_exact']:.3f}, default {r['perplexity_default']:.3f} "
          f"({100 * (r['perplexity_ratio'] - 1):+.2f}%)")
    print(f"greedy answers ({r['max_new_tokens']} tokens) identical to the end: "
          f"{r['answers_identical']} of {len(r['prompts'])}; first 8 tokens identical: "
          f"{100 * r['share_8_tokens_identical']:.0f}%; median identical prefix "
          f"{r['median_identical_prefix']} tokens")
    broken = check_bounds(r)
    print("within the stated bounds" if not broken else "OUTSIDE the bounds: " + "; ".join(broken))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(r, f, indent=1)
    return 1 if broken else 0


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Add the ``default-quality`` subcommand; its ``func`` is :func:`run_cli`."""
    p = bench_subparsers.add_parser(
        "default-quality", help="perplexity and greedy agreement of the default precision "
        "against --exact", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(p, ("model",))
    p.add_argument("--text-file", default="README.md", help="text whose perplexity is measured")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens of the text used")
    p.add_argument("--max-new-tokens", type=int, default=32, help="greedy tokens per chat prompt")
    p.add_argument("--bundle", action="store_true", help="measure the fast CPU bundle even "
                   "where it is not this CPU's default (AVX2 without VNNI: slow)")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run_cli)
    return p
