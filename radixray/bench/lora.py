"""``radixray bench lora``: output tok/s with 0, 1 and 4 distinct LoRA adapters in a batch
against the base model, side by side.

In-process, one run after another:

1. ``base``: an engine without LoRA;
2. ``lora_0``: an engine with the same options and ``--num-adapters`` adapters loaded
   (``lora_paths``), every request on the base model;
3. ``lora_1``: the same engine, every request on one adapter;
4. ``lora_4``: the same engine, requests spread round-robin over 4 distinct adapters.

(``--adapters-in-batch`` sets the counts of rows 2-4.) The adapters are made here: PEFT
folders (``adapter_config.json`` + ``adapter_model.safetensors``) of random A and B of rank
``--lora-rank`` on all seven projections of every decoder layer, shaped from the served
model, in a temporary folder removed at the end.

The workload: ``--num-prompts`` (default ``--concurrency``) random-token prompts of
``--input-len`` tokens submitted at once in one ``generate`` call, at most
``--concurrency`` running together (``max_running_requests``), each decoding exactly
``--output-len`` tokens greedily (ignore_eos). Before each configuration's runs, one
warm-up batch of other prompts (the same shape and adapters, a few tokens each) fills the
adapter slots and is left out; the prefix cache is flushed before every batch. Reported
per configuration, the median over its runs (``--repeats`` in each of ``--rounds``): output
tok/s (output tokens over the batch's wall time), the median TPOT (per request: decode
seconds over its tokens after the first), and the ratio of its tok/s to the base's; then
what the largest adapter count costs, ``1 - ratio``, against the target (under 25% of the
base's throughput). With ``--rounds`` N > 1 the two engines are started anew N times, the
base then the LoRA engine each round, and the cost is the median of the N rounds' costs,
each against its own round's base: a host whose speed drifts over minutes moves both sides
of a round alike.

    radixray bench lora --concurrency 32 --input-len 512 --output-len 128 \\
        --rounds 3 --output-json lora.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

from radixray.bench import (
    ENGINE_FLAGS,
    add_engine_arguments,
    random_token_prompts,
    register,
    save_json,
    workload_header,
)
from radixray.common.passing_thread import in_passing_thread

TARGET_MAX_COST = 0.25  # issue 39: 4 adapters cost under a quarter of the base's throughput
WARMUP_TOKENS = 8
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_random_adapters(model, root: str, count: int, rank: int, seed: int) -> dict[str, str]:
    """``count`` PEFT LoRA folders ``adapter_<i>`` under ``root`` for ``model`` (the served
    torch module, ``Engine.model_facts().module``): random A ``[rank, in]`` and B
    ``[out, rank]`` on q, k, v, o, gate, up and down of every decoder layer, lora_alpha =
    rank (scaling 1), seeded by ``seed`` and the adapter's index. Name -> folder."""
    import torch
    from safetensors.torch import save_file

    from radixray.engine.weights.lora_slots import lora_targets

    shapes = {}  # module -> (in, out)
    for target in lora_targets(model).values():
        for module, out in zip(target.modules, target.out_parts):
            shapes[module] = (target.in_features, out)
    out_paths = {}
    for i in range(count):
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        tensors = {}
        for layer in range(len(model.layers)):
            for module, (d_in, d_out) in shapes.items():
                prefix = f"base_model.model.model.layers.{layer}.{_PARENT[module]}.{module}"
                # A ~ N(0, 1/in) keeps x @ A.T at x's scale; a small B keeps the update a
                # perturbation, as a trained adapter's is
                tensors[f"{prefix}.lora_A.weight"] = (
                    torch.randn(rank, d_in, generator=gen) / d_in ** 0.5)
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.02
        folder = os.path.join(root, f"adapter_{i}")
        os.makedirs(folder, exist_ok=True)
        save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
                       "lora_alpha": rank, "lora_dropout": 0.0, "bias": "none",
                       "use_rslora": False, "use_dora": False,
                       "target_modules": sorted(shapes)}, f, indent=1)
        out_paths[f"adapter_{i}"] = folder
    return out_paths


def _batch_adapters(names: list[str], count: int, n: int) -> list[str | None]:
    """Each of ``n`` requests' adapter: none for ``count`` 0, else ``names[:count]``
    round-robin."""
    return [names[i % count] if count else None for i in range(n)]


def time_batch(engine, prompts: list[list[int]], output_len: int,
               adapters: list[str | None] | None) -> dict:
    """``prompts`` submitted at once (``adapters``: each one's lora_path; None without LoRA),
    ``output_len`` greedy tokens each, after a cache flush: wall seconds, output tok/s,
    median TPOT and decode steps taken."""
    params = {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}
    assert engine.flush_cache(), "the prefix cache could not be flushed between runs"
    steps0 = engine.snapshot().decode_steps
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params,
                           **({"lora_path": adapters} if adapters is not None else {}))
    seconds = time.perf_counter() - t0
    steps = engine.snapshot().decode_steps - steps0
    tokens = sum(len(o["output_ids"]) for o in outs)
    tpots = [(o["meta_info"]["e2e_latency"] - o["meta_info"]["first_token_latency"])
             / (len(o["output_ids"]) - 1) for o in outs if len(o["output_ids"]) > 1]
    return {"seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
            "median_tpot_ms": 1e3 * statistics.median(tpots) if tpots else None,
            "decode_steps": steps}


def _measure(engine, label: str, prompts, warmup, args, adapters, runs: list) -> None:
    """One configuration in one round: a warm-up batch left out, then ``args.repeats`` timed
    batches appended to ``runs``."""
    time_batch(engine, warmup, min(WARMUP_TOKENS, args.output_len), adapters)
    for r in range(args.repeats):
        runs.append(time_batch(engine, prompts, args.output_len, adapters))
        print(f"{label}: run {r + 1}/{args.repeats}: {runs[-1]['output_tokens_per_s']:.1f} out "
              f"tok/s, {runs[-1]['seconds']:.1f} s", flush=True)


def _row(label: str, count: int, lora_engine: bool, runs: list[dict]) -> dict:
    """A configuration's row: the medians over every round's runs, and the runs."""
    tpots = [r["median_tpot_ms"] for r in runs if r["median_tpot_ms"] is not None]
    return {"config": label, "lora_engine": lora_engine, "adapters_in_batch": count,
            "output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in runs),
            "median_tpot_ms": statistics.median(tpots) if tpots else None,
            "output_tokens": runs[0]["output_tokens"], "runs": runs}


def _round_costs(base: dict, most: dict, rounds: int, repeats: int) -> list[float]:
    """Row ``most``'s cost in each round against that round's ``base``: ``1 -`` the ratio of
    their median tok/s (the base and the LoRA engine measured back to back)."""
    def rate(row, k):
        return statistics.median(r["output_tokens_per_s"]
                                 for r in row["runs"][k * repeats:(k + 1) * repeats])
    return [1 - rate(most, k) / rate(base, k) for k in range(rounds)]


@dataclass(frozen=True)
class _Workload:
    """What every round runs: the timed and the warm-up prompts, the adapters written to
    disk (name -> folder), and the precision the engines ran at (for the report)."""

    prompts: list[list[int]]
    warmup: list[list[int]]
    paths: dict[str, str]
    precision: dict

    @classmethod
    def of(cls, base, args, n: int, scratch: str) -> _Workload:
        """Made once, from the first round's base engine; the adapters go under ``scratch``."""
        facts = base.model_facts()
        vocab = base.limits.vocab_size
        # on a thread that ends with it, so no OpenMP team stays behind (passing_thread.py)
        paths = in_passing_thread(write_random_adapters, facts.module, scratch,
                                  args.num_adapters, args.lora_rank, args.seed)
        return cls(prompts=random_token_prompts(n, args.input_len, vocab, args.seed),
                   warmup=random_token_prompts(n, args.input_len, vocab, args.seed + 1),
                   paths=paths,
                   precision={"precision": facts.precision, "quantization": facts.quantization,
                              "kv_cache_dtype": facts.kv_cache_dtype,
                              "quantize_lm_head": facts.quantize_lm_head})


def _engine_options(args) -> dict:
    """The engine options both engines share: the flags given, the KV pool sized for the
    workload, ``--concurrency`` running at most."""
    names = ENGINE_FLAGS + ("exact", "enable_torch_compile", "num_threads", "device")
    options = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    options["max_total_tokens"] = args.concurrency * (args.input_len + args.output_len + 8) + 256
    options["max_running_requests"] = args.concurrency
    return options


def run(args) -> dict:
    import torch

    from radixray import Engine
    counts = [int(c) for c in str(args.adapters_in_batch).split(",")]
    if args.num_adapters < 1:
        raise ValueError(f"--num-adapters must be >= 1, got {args.num_adapters}")
    if min(counts) < 0 or max(counts) > args.num_adapters:
        raise ValueError(f"--adapters-in-batch {counts}: each must be in [0, --num-adapters="
                         f"{args.num_adapters}]")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    n = args.num_prompts or args.concurrency
    options = _engine_options(args)
    scratch = tempfile.mkdtemp(prefix="radixray-bench-lora-")
    runs: dict[str, list] = {label: [] for label in ["base"] + [f"lora_{c}" for c in counts]}
    work = None
    try:
        for round_no in range(1, args.rounds + 1):
            if args.rounds > 1:
                print(f"round {round_no}/{args.rounds}", flush=True)
            with Engine(**options) as base:
                work = work or _Workload.of(base, args, n, scratch)
                _measure(base, "base", work.prompts, work.warmup, args, None, runs["base"])
            lora_options = dict(options, lora_paths=[f"{name}={path}"
                                                     for name, path in work.paths.items()],
                                max_loras_per_batch=max(8, max(counts)))
            with Engine(**lora_options) as eng:
                for count in counts:
                    _measure(eng, f"lora_{count}", work.prompts, work.warmup, args,
                             _batch_adapters(sorted(work.paths), count, n),
                             runs[f"lora_{count}"])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = [_row("base", 0, False, runs["base"])]
    rows += [_row(f"lora_{c}", c, True, runs[f"lora_{c}"]) for c in counts]
    for row in rows:
        row["ratio_to_base"] = row["output_tokens_per_s"] / rows[0]["output_tokens_per_s"]
    most = max(rows[1:], key=lambda row: row["adapters_in_batch"])
    costs = _round_costs(rows[0], most, args.rounds, args.repeats)
    cost = statistics.median(costs)
    out = {"model": args.model, **work.precision, "engine_options": options,
           "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
           "concurrency": args.concurrency, "num_prompts": n, "input_len": args.input_len,
           "output_len": args.output_len, "repeats": args.repeats, "rounds": args.rounds,
           "lora_rank": args.lora_rank, "num_adapters": args.num_adapters,
           "adapter_modules": sorted(_PARENT), "rows": rows,
           "adapter_cost": {"adapters_in_batch": most["adapters_in_batch"], "cost": cost,
                            "round_costs": costs, "target_max": TARGET_MAX_COST,
                            "meets_target": cost < TARGET_MAX_COST}}
    print_report(out)
    save_json(out, args.output_json)
    return out


def print_report(r: dict) -> None:
    print(f"\n{workload_header(r)}, {r['concurrency']} at once; "
          f"{r['num_adapters']} adapters of rank {r['lora_rank']} loaded; medians of "
          f"{r['repeats'] * r['rounds']} run(s) ({r['rounds']} round(s))")
    print(f"{'config':<8} {'adapters':>8} {'out tok/s':>10} {'p50 TPOT ms':>11} {'x base':>7}")
    for row in r["rows"]:
        tpot = "-" if row["median_tpot_ms"] is None else f"{row['median_tpot_ms']:.1f}"
        adapters = "off" if not row["lora_engine"] else str(row["adapters_in_batch"])
        print(f"{row['config']:<8} {adapters:>8} {row['output_tokens_per_s']:>10.1f} {tpot:>11} "
              f"{row['ratio_to_base']:>7.3f}")
    c = r["adapter_cost"]
    per_round = (" (median of the rounds: " + ", ".join(f"{100 * x:.1f}%"
                                                          for x in c["round_costs"]) + ")"
                 if len(c["round_costs"]) > 1 else "")
    print(f"{c['adapters_in_batch']} adapters cost {100 * c['cost']:.1f}% of the base's "
          f"throughput{per_round} (target < {100 * c['target_max']:.0f}%: "
          f"{'met' if c['meets_target'] else 'missed'})")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p, ENGINE_FLAGS + ("exact", "enable_torch_compile", "num_threads",
                                            "device"))
    p.add_argument("--concurrency", type=int, default=32,
                   help="requests running together (max_running_requests)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per batch, submitted at once (default: --concurrency)")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--lora-rank", type=int, default=16, help="rank of the generated adapters")
    p.add_argument("--num-adapters", type=int, default=4, help="adapters the LoRA engine loads")
    p.add_argument("--adapters-in-batch", default="0,1,4",
                   help="comma-separated distinct adapter counts, one LoRA-engine row each")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed batches per configuration in each round")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of base engine then LoRA engine, each engine started anew; "
                        "the cost is the median of the rounds' costs, each against its own "
                        "round's base, so drift of the host falls on both sides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None, help="write the results as JSON here")


def add_parser(bench_subparsers) -> None:
    """Register ``lora`` on the ``radixray bench`` subparsers."""
    register(bench_subparsers, "lora", "in-process: output tok/s with 0, 1 and 4 LoRA adapters "
             "in the batch against the base model", _add_arguments, run)
