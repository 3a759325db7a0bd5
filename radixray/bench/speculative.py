"""``radixray bench spec``: decode tokens/s with and without n-gram speculative decoding.

Two engines over the same model, one with ``speculative_algorithm=NGRAM``, measured side by
side in one process, alternating runs, on two workloads:

- **repetitive**: a passage followed by an instruction to repeat it and its first words,
  so the answer copies text the prompt already holds (code edits, RAG answers);
- **random**: prompts of random token ids, answered greedily (a small model's greedy
  continuation of noise often falls into loops, which drafts then predict);
- **random_t1**: the same prompts sampled at temperature 1 (seeded), whose continuations
  rarely repeat: what speculation costs when its drafts fail.

Each run sends ``--prompts`` greedy requests ``--batch`` at a time and measures decode
tokens/s: tokens after the first over the time after the first token, summed over the
requests. The median over ``--repeats`` runs is reported with the accept length (tokens
committed per request per verify forward) and, for the greedy workloads, how many outputs
were identical.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from radixray.bench import add_engine_arguments

PASSAGE = (
    "def merge_sorted(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
    "            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n"
    "    return out\n")
TOPICS = ("merge", "sorted", "lists", "append", "extend", "index", "loop", "return")


def repetitive_prompts(tokenize, n: int) -> list[list[int]]:
    """``n`` copy tasks: a passage (renamed per prompt), then the order to repeat it and its
    first line."""
    out = []
    for i in range(n):
        text = PASSAGE.replace("merge_sorted", f"{TOPICS[i % len(TOPICS)]}_{i}")
        first = text.splitlines()[0]
        out.append(tokenize(f"{text}\nRepeat the code above exactly.\n\n{first}\n"))
    return out


def random_prompts(vocab: int, n: int, length: int = 64, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


def measure(engine, prompts: list[list[int]], batch: int, max_new_tokens: int,
            temperature: float = 0.0) -> dict:
    """One run: decode tokens/s over ``prompts`` sent ``batch`` at a time; outputs kept.
    Sampled runs seed each request by its index."""
    params = [{"temperature": temperature, "max_new_tokens": max_new_tokens, "ignore_eos": True,
               **({"seed": i} if temperature > 0 else {})} for i in range(len(prompts))]
    tokens, seconds, outputs, verify, committed = 0, 0.0, [], 0, 0.0
    for start in range(0, len(prompts), batch):
        group = prompts[start:start + batch]
        results = engine.generate(input_ids=group, sampling_params=params[start:start + batch])
        decode_s = max(r["meta_info"]["e2e_latency"] - r["meta_info"]["first_token_latency"]
                       for r in results)
        tokens += sum(len(r["output_ids"]) - 1 for r in results)
        seconds += decode_s
        for r in results:
            outputs.append(r["output_ids"])
            ct = r["meta_info"].get("spec_verify_ct", 0)
            verify += ct
            committed += ct * r["meta_info"].get("spec_accept_length", 0.0)
    return {"decode_tok_s": tokens / max(seconds, 1e-9), "outputs": outputs,
            "accept_length": committed / verify if verify else None}


def run(args) -> dict:
    from radixray import Engine
    common = dict(model=args.model, max_total_tokens=args.max_total_tokens)
    if args.num_threads:
        common["num_threads"] = args.num_threads
    with Engine(**common) as plain, Engine(
            **common, speculative_algorithm="NGRAM",
            speculative_num_draft_tokens=args.num_draft_tokens) as spec:
        tok = plain.tokenizer
        noise = random_prompts(plain.limits.vocab_size, args.prompts)
        workloads = {  # name -> (prompts, temperature)
            "repetitive": (repetitive_prompts(lambda s: tok.encode(s), args.prompts), 0.0),
            "random": (noise, 0.0),
            "random_t1": (noise, 1.0),
        }
        report = {"model": args.model, "batch": args.batch, "prompts": args.prompts,
                  "max_new_tokens": args.max_new_tokens,
                  "num_draft_tokens": args.num_draft_tokens, "workloads": {}}
        for name, (prompts, temperature) in workloads.items():
            measure(plain, prompts[:1], 1, 8)  # warm both engines' paths
            measure(spec, prompts[:1], 1, 8)
            runs = {"off": [], "on": []}
            outs, accept = {}, []
            for _ in range(args.repeats):
                for mode, eng in (("off", plain), ("on", spec)):
                    eng.flush_cache()
                    m = measure(eng, prompts, args.batch, args.max_new_tokens, temperature)
                    runs[mode].append(m["decode_tok_s"])
                    outs[mode] = m["outputs"]
                    if mode == "on":
                        accept.append(m["accept_length"] or 1.0)
            off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
            same = (sum(a == b for a, b in zip(outs["off"], outs["on"]))
                    if temperature == 0 else None)
            report["workloads"][name] = {
                "decode_tok_s_off": off, "decode_tok_s_on": on, "speedup": on / off,
                "accept_length": statistics.median(accept), "identical_outputs": same,
                "runs_off": runs["off"], "runs_on": runs["on"]}
    return report


def run_cli(args) -> int:
    report = run(args)
    print(f"model {args.model}, batch {args.batch}, {args.prompts} prompts x "
          f"{args.max_new_tokens} tokens, medians of {args.repeats} runs")
    print(f"{'workload':<11} {'off tok/s':>10} {'NGRAM tok/s':>12} {'speedup':>8} "
          f"{'accept len':>10} {'identical':>9}")
    for name, w in report["workloads"].items():
        print(f"{name:<11} {w['decode_tok_s_off']:>10.1f} {w['decode_tok_s_on']:>12.1f} "
              f"{w['speedup']:>7.2f}x {w['accept_length']:>10.2f} "
              f"{'-' if w['identical_outputs'] is None else w['identical_outputs']:>4}"
              f"/{args.prompts}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Add the ``spec`` subcommand; its ``func`` is :func:`run_cli`."""
    p = bench_subparsers.add_parser(
        "spec", help="decode tokens/s with and without n-gram speculative decoding",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(p, ("model", "max_total_tokens", "num_threads"), max_total_tokens=16384)
    p.add_argument("--prompts", type=int, default=4, help="requests per workload and run")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-draft-tokens", type=int, default=8,
                   help="speculative_num_draft_tokens of the NGRAM engine")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is reported")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run_cli)
    return p
