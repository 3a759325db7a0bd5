"""``radixray bench ep``: what expert parallelism costs, EP 1 against EP N, on one machine.

For each ``--ep-sizes`` value, a group of that many engines (one process each, gloo on
127.0.0.1; EP 1 is one plain engine) serves the same workload: ``--requests`` prompts of
``--prompt-len`` random tokens, ``--max-new-tokens`` greedy tokens each, split evenly over
the ranks, each rank's share submitted as one batch after a warm-up request. Reported
per EP size: output tokens/s (all ranks' tokens over the slowest rank's time), the
seconds each rank spent in forward passes, the share of them inside the MoE exchanges
(the dispatchers' collective timers), and the bytes the exchanges moved per token per
MoE layer, next to the formula of ``engine/ep/dispatch.py``.

The model is ``--model`` (a Hugging Face MoE folder) or, by default, a random-weight
Qwen3-MoE built here (``--tiny``: 4 layers, hidden 256, 16 experts, top 4), with the
default model's tokenizer. On a 2-core machine EP does not speed anything up (the ranks
share the cores); the point is what the collectives cost.

    radixray bench ep --ep-sizes 1,2 --output docs/data/ep.json
"""

from __future__ import annotations

import logging
import tempfile
import time

from radixray.bench import (
    add_group_arguments,
    median_run,
    random_token_prompts,
    report_group,
)
from radixray.engine.ep.group import free_tcp_address

logger = logging.getLogger(__name__)


def build_tiny_moe(folder: str, seed: int = 0) -> str:
    """A random-weight Qwen3-MoE in ``folder`` with the default model's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from radixray.engine.weights.loader import resolve_model
    tokenizer = resolve_model("default").tokenizer
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512,
        moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, max_position_embeddings=2048, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, initializer_range=0.05)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _rank(rank: int, size: int, address: str | None, model: str, shares, args: dict,
          results) -> None:
    """One rank: warm up, run its share as one batch, report tokens, times and bytes."""
    import torch

    from radixray import Engine
    ep = {"ep_size": size, "ep_rank": rank, "ep_init_method": address} if size > 1 else {}
    eng = Engine(model=model, dtype="float32", max_total_tokens=args["max_total_tokens"],
                 num_threads=args["threads"], **ep)
    forward = eng.time_forwards()
    facts = eng.model_facts()
    params = {"max_new_tokens": args["max_new_tokens"], "temperature": 0.0, "ignore_eos": True}
    try:
        eng.generate(input_ids=shares[rank][:1], sampling_params={**params, "max_new_tokens": 2})
        blocks = getattr(facts.module, "moe_blocks", [])
        for block in blocks:  # count the measured run only
            if hasattr(block.experts, "counters"):
                block.experts.counters = type(block.experts.counters)()
        forward.seconds = 0.0
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=shares[rank], sampling_params=params)
        elapsed = time.perf_counter() - t0
        counters = [b.experts.counters for b in blocks if hasattr(b.experts, "counters")]
        results.put({"rank": rank, "tokens": sum(len(o["output_ids"]) for o in outs),
                     "elapsed_s": elapsed, "forward_s": forward.seconds,
                     "comm_s": sum(c.seconds for c in counters),
                     "bytes_sent": sum(c.bytes_sent for c in counters),
                     "moe_layers": len(blocks), "hidden": eng.hf_config.hidden_size,
                     "top_k": eng.hf_config.num_experts_per_tok,
                     "dtype": str(facts.dtype).replace("torch.", ""),
                     "torch_threads": torch.get_num_threads()})
        time.sleep(1.0)  # let every rank report before the group stops
    finally:
        eng.shutdown()


def run_size(model: str, size: int, prompts: list[list[int]], args: dict) -> dict:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    shares = [prompts[r::size] for r in range(size)]
    address = free_tcp_address() if size > 1 else None
    procs = [ctx.Process(target=_rank, args=(r, size, address, model, shares, args, results))
             for r in range(size)]
    for p in procs:
        p.start()
    ranks = sorted((results.get(timeout=args["timeout_s"]) for _ in procs),
                   key=lambda r: r["rank"])
    for p in procs:
        p.join(60)
    slowest = max(r["elapsed_s"] for r in ranks)
    tokens = sum(r["tokens"] for r in ranks)
    forward = sum(r["forward_s"] for r in ranks)
    comm = sum(r["comm_s"] for r in ranks)
    first = ranks[0]
    pairs_tokens = tokens + sum(len(p) for p in prompts)  # tokens through each MoE layer
    return {"ep_size": size, "output_tokens": tokens, "seconds": slowest,
            "tokens_per_s": tokens / slowest, "forward_s": forward, "comm_s": comm,
            "comm_share_of_forward": comm / forward if forward else 0.0,
            "bytes_sent": sum(r["bytes_sent"] for r in ranks),
            "bytes_per_token_per_layer": sum(r["bytes_sent"] for r in ranks)
            / max(1, pairs_tokens * first["moe_layers"]),
            "ranks": ranks}


def run(args) -> dict:
    import torch

    from radixray.engine.ep.dispatch import a2a_bytes_per_token
    model = args.model
    tmp = None
    if model is None:
        tmp = tempfile.mkdtemp(prefix="radixray-ep-bench-")
        model = build_tiny_moe(tmp)
    prompts = random_token_prompts(args.requests, args.prompt_len, 1000, seed=0)
    opts = {"max_new_tokens": args.max_new_tokens, "max_total_tokens": args.max_total_tokens,
            "threads": args.threads, "timeout_s": args.timeout_s}
    rows = []
    for size in args.ep_sizes:
        best = median_run(lambda size=size: run_size(model, size, prompts, opts), args.repeats)
        rows.append(best)
        logger.info("EP %d: %.1f tok/s (median of %s), comm %.1f%% of forward time, %.0f B "
                    "per token per MoE layer", size, best["tokens_per_s"],
                    best["tokens_per_s_runs"], 100 * best["comm_share_of_forward"],
                    best["bytes_per_token_per_layer"])
    first = rows[0]["ranks"][0]
    dispatch, combine = a2a_bytes_per_token(first["hidden"], first["top_k"],
                                            getattr(torch, first["dtype"]))
    return report_group(
        rows, args, "EP", "ep_size", args.model or "tiny random Qwen3-MoE (bench/expert_parallel.py)",
        {"formula_bytes_per_token_per_layer_all_remote": dispatch + combine},
        f"formula, every expert remote: {dispatch + combine} B per token per MoE layer "
        f"({dispatch} dispatch + {combine} combine)")


def add_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("ep", help="expert parallelism: EP 1 vs N throughput and "
                                    "the cost of the MoE exchanges")
    p.add_argument("--model", default=None, help="a Hugging Face MoE folder (default: a tiny "
                   "random Qwen3-MoE built for the run)")
    add_group_arguments(p, "--ep-sizes", [1, 2])
    p.add_argument("--timeout-s", type=float, default=600)
    p.set_defaults(func=lambda args: (run(args), 0)[1])
