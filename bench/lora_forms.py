"""Two forms of the batched LoRA matmul side by side in one engine (kernels/lora.py).

``--compare decode-forms`` (the default): the decode op's two forms. The scheduler keeps
its running requests grouped by adapter slot, so each adapter's rows of a decode batch
are one run and the op updates them through views of the batch (the runs form). The
groups form gathers each slot's rows, pads them and gathers the updates back; it serves
batches whose rows are not grouped.

``--compare expand-parts``: a long prefill run's expand of a fused target (q|k|v, gate|up)
part by part on the diagonal blocks of its B (``MIN_PART_ROWS`` rows and up) against one
GEMM over the whole block-diagonal B (``MIN_PART_ROWS`` set past any run).

``--compare int8-shrink``: in an int8 engine (the default precision), the long runs' shrinks
as int8 GEMMs on the activations' codes (kernels/lora.py ``Int8Shrink``) against the fp32
shrinks of the same runs (``LoraSlots.int8_shrink`` off). Their tokens may differ: the int8
shrink rounds x and A to int8 first.

The decode forms give the same tokens. The expand forms agree to the last bits only (a
GEMM over the whole B sums three or two times as many terms, the extra ones zero, in
another order), so long greedy runs of the default int8 model can part ways.

This script times a workload (``--num-prompts`` random prompts of ``--input-len`` tokens,
``--output-len`` greedy tokens each, adapters round-robin) with each form in turn,
alternating which goes first each round, in one process and one engine, so the host's
drift falls on both alike. It reports each form's median TPOT and batch seconds, the
rounds the first form was faster in (by TPOT, or by seconds when a request makes one
token), and whether the tokens were equal.

    .venv/bin/python bench/lora_forms.py --rounds 6 --output-json forms.json
    .venv/bin/python bench/lora_forms.py --compare expand-parts --input-len 512 \
        --output-len 1 --rounds 6 --output-json parts.json
    .venv/bin/python bench/lora_forms.py --compare int8-shrink --input-len 512 \
        --output-len 1 --rounds 4 --output-json int8.json

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
    p.add_argument("--compare", choices=("decode-forms", "expand-parts", "int8-shrink"),
                   default="decode-forms", help="which pair of forms (the docstring)")
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
    tpots = [(o["meta_info"]["e2e_latency"] - o["meta_info"]["first_token_latency"])
             / (len(o["output_ids"]) - 1) for o in outs if len(o["output_ids"]) > 1]
    tpot = 1e3 * statistics.median(tpots) if tpots else None
    return seconds, tpot, [o["output_ids"] for o in outs]


def _forms(compare: str, lora_kernels) -> dict:
    """Each form's name -> a function of the LoRA engine that puts the form in place; the
    first form is the engine's own. The caller puts the engine's back with the first."""
    if compare == "expand-parts":
        def threshold(rows):
            return lambda _engine: setattr(lora_kernels, "MIN_PART_ROWS", rows)
        return {"parts": threshold(lora_kernels.MIN_PART_ROWS), "whole": threshold(1 << 62)}
    if compare == "int8-shrink":
        def int8(on):
            def use(engine):
                if not engine.runner.lora.a_q:
                    raise SystemExit("--compare int8-shrink needs an int8 engine (the default "
                                     "precision, or quantization w8a8_int8)")
                engine.runner.lora.int8_shrink = on
            return use
        return {"int8": int8(True), "fp32": int8(False)}
    plan_of = lora_kernels.LoraSegments.__dict__["of"]  # the classmethod itself
    groups = functools.partial(lora_kernels.LoraSegments.of, runs=False)  # bound: no descriptor
    return {"runs": lambda _engine: setattr(lora_kernels.LoraSegments, "of", plan_of),
            "groups": lambda _engine: setattr(lora_kernels.LoraSegments, "of", groups)}


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    from radixray import Engine
    from radixray.bench import random_token_prompts, save_json
    from radixray.bench.lora import write_random_adapters
    from radixray.common.passing_thread import in_passing_thread
    from radixray.kernels import lora as lora_kernels

    forms = _forms(args.compare, lora_kernels)
    first, second = forms
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
                for use in forms.values():  # warm-up, left out
                    use(engine)
                    _timed_batch(engine, prompts, adapters, args.output_len)
                for r in range(args.rounds):
                    order = list(forms) if r % 2 == 0 else list(forms)[::-1]
                    for form in order:
                        forms[form](engine)
                        seconds, tpot, tokens = _timed_batch(engine, prompts, adapters,
                                                             args.output_len)
                        rows[form].append({"seconds": seconds, "median_tpot_ms": tpot,
                                           "tokens": tokens})
                        print(f"round {r + 1}/{args.rounds} {form}: {seconds:.2f} s"
                              + (f", p50 TPOT {tpot:.2f} ms" if tpot else ""), flush=True)
            finally:
                forms[first](engine)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    key = "median_tpot_ms" if args.output_len > 1 else "seconds"
    out = {"compare": args.compare, "options": options, "num_prompts": args.num_prompts,
           "input_len": args.input_len, "output_len": args.output_len,
           "num_adapters": args.num_adapters, "lora_rank": args.lora_rank,
           "rounds": args.rounds, "compared_by": key,
           "same_tokens": all(a["tokens"] == b["tokens"]
                              for a, b in zip(rows[first], rows[second])),
           f"{first}_faster_rounds": sum(a[key] < b[key]
                                         for a, b in zip(rows[first], rows[second]))}
    for form, runs in rows.items():
        tpots = [x["median_tpot_ms"] for x in runs if x["median_tpot_ms"] is not None]
        out[form] = {"median_tpot_ms": statistics.median(tpots) if tpots else None,
                     "median_seconds": statistics.median(x["seconds"] for x in runs),
                     "seconds": [round(x["seconds"], 2) for x in runs],
                     "tpot_ms": [round(t, 2) for t in tpots]}
    measure, field, unit = (("p50 TPOT", "median_tpot_ms", "ms") if key == "median_tpot_ms"
                            else ("batch seconds", "median_seconds", "s"))
    print(f"{first}: {measure} {out[first][field]:.2f} {unit}; {second}: "
          f"{out[second][field]:.2f} {unit}; {first} faster in "
          f"{out[f'{first}_faster_rounds']}/{args.rounds} rounds; "
          f"same tokens: {out['same_tokens']}")
    save_json(out, args.output_json)
    return out


if __name__ == "__main__":
    main()
