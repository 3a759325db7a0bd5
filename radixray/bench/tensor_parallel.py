"""``radixray bench tp``: what tensor parallelism costs, TP 1 against TP N, on one machine.

For each ``--tp-sizes`` value an in-process engine of that size (its followers are local
processes, gloo over 127.0.0.1) serves the same workload: ``--requests`` prompts of
``--prompt-len`` random tokens, ``--max-new-tokens`` greedy tokens each, as one batch after a
warm-up request; the median of ``--repeats`` runs is reported. Per TP size: output
tokens/s, the driver's seconds in forward passes, the share of them inside the model's
collectives (all-reduces after ``o_proj`` and ``down_proj``, the embedding's all-reduce, the
logits' all-gather; they include waiting for the slowest rank), and the bytes each rank
gave to them per token per layer, next to the formula (two all-reduces of ``hidden`` values
per token per layer).

``--model`` defaults to the default model (SmolLM2-135M, whose 9 query and 3 KV heads
allow TP 1 and 3); ``--threads`` torch threads per rank. On a 2-core machine TP does not
speed anything up (the ranks share the cores); the point is what the collectives cost.

    radixray bench tp --tp-sizes 1,3 --output docs/data/tp.json
"""

from __future__ import annotations

import logging
import time

from radixray.bench import (
    add_group_arguments,
    median_run,
    random_token_prompts,
    report_group,
)

logger = logging.getLogger(__name__)


def run_size(model: str, size: int, prompts: list[list[int]], args) -> dict:
    """One engine of ``size`` ranks: warm up, run the batch, report."""
    from radixray import Engine
    eng = Engine(model=model, dtype="float32", max_total_tokens=args.max_total_tokens,
                 num_threads=args.threads, tp_size=size)
    try:
        forward = eng.time_forwards()
        tp = eng.model_facts().module.tp  # the collectives and their counters
        params = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0,
                  "ignore_eos": True}
        eng.generate(input_ids=prompts[:1], sampling_params={**params, "max_new_tokens": 2})
        forward.seconds, tp.comm_seconds, tp.comm_calls, tp.comm_bytes = 0.0, 0.0, 0, 0
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        elapsed = time.perf_counter() - t0
        tokens = sum(len(o["output_ids"]) for o in outs)
        passed = tokens + sum(len(p) for p in prompts)  # tokens through every layer
        layers = eng.hf_config.num_hidden_layers
        return {"tp_size": size, "output_tokens": tokens, "seconds": elapsed,
                "tokens_per_s": tokens / elapsed, "forward_s": forward.seconds,
                "comm_s": tp.comm_seconds, "comm_calls": tp.comm_calls,
                "comm_share_of_forward": tp.comm_seconds / forward.seconds
                if forward.seconds else 0.0,
                "bytes_per_token_per_layer": tp.comm_bytes / max(1, passed * layers),
                "hidden": eng.hf_config.hidden_size, "layers": layers}
    finally:
        eng.shutdown()


def run(args) -> dict:
    model = args.model
    from radixray.engine.weights.loader import resolve_model
    vocab = min(10000, resolve_model(model).config.vocab_size)
    prompts = random_token_prompts(args.requests, args.prompt_len, vocab, seed=0)
    rows = []
    for size in args.tp_sizes:
        best = median_run(lambda size=size: run_size(model, size, prompts, args), args.repeats)
        rows.append(best)
        logger.info("TP %d: %.1f tok/s (median of %s), collectives %.1f%% of forward time",
                    size, best["tokens_per_s"], best["tokens_per_s_runs"],
                    100 * best["comm_share_of_forward"])
    hidden = rows[0]["hidden"]
    formula = 2 * hidden * 4  # two fp32 all-reduces of the hidden state per token per layer
    return report_group(
        rows, args, "TP", "tp_size", model, {"formula_bytes_per_token_per_layer": formula},
        f"formula: {formula} B per token per layer given by each rank (two fp32 all-reduces "
        f"of hidden {hidden}; plus the embedding's and the logits' per token)")


def add_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("tp", help="tensor parallelism: TP 1 vs N throughput and "
                                    "the share of the forward pass in its collectives")
    p.add_argument("--model", default="default", help="a model whose heads the sizes divide")
    add_group_arguments(p, "--tp-sizes", [1, 3])
    p.set_defaults(func=lambda args: (run(args), 0)[1])
