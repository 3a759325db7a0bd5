"""The LoRA decode op's two forms, side by side in one engine (kernels/lora.py).

The scheduler keeps its running requests grouped by adapter slot, so each adapter's rows
of a decode batch are one run and the op updates them through views of the batch (the
runs form). The groups form gathers each slot's rows, pads them and gathers the updates
back; it serves batches whose rows are not grouped. Both give the same tokens. This script
times a decode-dominated workload (``--num-prompts`` random prompts of ``--input-len``
tokens, ``--output-len`` greedy tokens each, adapters round-robin) with each form in turn,
alternating which goes first each round, in one process and one engine, so the host's
drift falls on both alike. It reports each form's median TPOT and batch seconds, the
rounds the runs form was faster in, and whether the tokens were equal.

    .venv/bin/python bench/lora_decode_forms.py --rounds 6 --output-json forms.json

Run it alone on the machine. Default precision (the fast CPU default) unless engine flags
are given through ``--engine-json`` (a JSON object of Engine options).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import tempfile
import time


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--engine-json", default="{}", help="extra Engine options, a JSON object")
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def _timed_batch(engine, prompts, adapters, output_len) -> tuple[float, float, list]:
    """One batch after a cache flush: wall seconds, median TPOT (ms), the tokens."""
    params = {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}
    assert engine.flush_cache(), "the prefix cache could not be flushed between runs"
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params, lora_path=adapters)
    seconds = time.perf_counter() - t0
    tpot = statistics.median((o["meta_info"]["e2e_latency"] - o["meta_info"]["first_token_latency"])
                             / (len(o["output_ids"]) - 1) for o in outs)
    return seconds, 1e3 * tpot, [o["output_ids"] for o in outs]


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    from radixray import Engine
    from radixray.bench import random_token_prompts
    from radixray.bench.lora import write_random_adapters
    from radixray.common.passing_thread import in_passing_thread
    from radixray.kernels import lora as lora_kernels

    original = lora_kernels.LoraSegments.__dict__["of"]  # the classmethod, put back at the end
    plan_of = lora_kernels.LoraSegments.of
    forms = {"runs": plan_of, "groups": functools.partial(plan_of, runs=False)}
    options = dict(json.loads(args.engine_json), max_running_requests=args.num_prompts,
                   max_total_tokens=args.num_prompts * (args.input_len + args.output_len + 8)
                   + 256)
    scratch = tempfile.mkdtemp(prefix="radixray-lora-forms-")
    rows = {form: [] for form in forms}
    try:
        with Engine(**options) as base:
            facts = base.model_facts()
            vocab = base.limits.vocab_size
            paths = in_passing_thread(write_random_adapters, facts.module, scratch,
                                      args.num_adapters, args.lora_rank, args.seed)
            del facts
        names = sorted(paths)
        prompts = random_token_prompts(args.num_prompts, args.input_len, vocab, args.seed)
        adapters = [names[i % len(names)] for i in range(args.num_prompts)]
        with Engine(**options, lora_paths=[f"{k}={v}" for k, v in paths.items()],
                    max_loras_per_batch=max(8, args.num_adapters)) as engine:
            try:
                for of in forms.values():  # warm-up, left out
                    lora_kernels.LoraSegments.of = of
                    _timed_batch(engine, prompts, adapters, args.output_len)
                for r in range(args.rounds):
                    order = list(forms) if r % 2 == 0 else list(forms)[::-1]
                    for form in order:
                        lora_kernels.LoraSegments.of = forms[form]
                        seconds, tpot, tokens = _timed_batch(engine, prompts, adapters,
                                                             args.output_len)
                        rows[form].append({"seconds": seconds, "median_tpot_ms": tpot,
                                           "tokens": tokens})
                        print(f"round {r + 1}/{args.rounds} {form}: {seconds:.2f} s, "
                              f"p50 TPOT {tpot:.2f} ms", flush=True)
            finally:
                lora_kernels.LoraSegments.of = original
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out = {"options": options, "num_prompts": args.num_prompts, "input_len": args.input_len,
           "output_len": args.output_len, "num_adapters": args.num_adapters,
           "lora_rank": args.lora_rank, "rounds": args.rounds,
           "same_tokens": all(a["tokens"] == b["tokens"]
                              for a, b in zip(rows["runs"], rows["groups"])),
           "runs_faster_rounds": sum(a["median_tpot_ms"] < b["median_tpot_ms"]
                                     for a, b in zip(rows["runs"], rows["groups"]))}
    for form, runs in rows.items():
        out[form] = {"median_tpot_ms": statistics.median(x["median_tpot_ms"] for x in runs),
                     "median_seconds": statistics.median(x["seconds"] for x in runs),
                     "tpot_ms": [round(x["median_tpot_ms"], 2) for x in runs]}
    print(f"runs form: p50 TPOT {out['runs']['median_tpot_ms']:.2f} ms; groups form "
          f"{out['groups']['median_tpot_ms']:.2f} ms; runs faster in "
          f"{out['runs_faster_rounds']}/{args.rounds} rounds; same tokens: {out['same_tokens']}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
