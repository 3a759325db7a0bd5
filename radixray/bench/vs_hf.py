"""``radixray bench vs-hf``: the serving benchmark's random workload in-process, without HTTP.

radixray's engine at each ``--concurrency`` (that many client threads, each sending its
next prompt when its last one finished, as ``bench serve --max-concurrency`` does)
against transformers ``generate`` one request at a time (the naive server's loop without
FastAPI). Both decode ``--output-len`` tokens per prompt (ignore_eos) from the same random
prompts on one device, so the ratio of output token rates is what batching, the paged KV
cache and the kernels give before any serving cost.

The naive loop's rate does not depend on concurrency (one request at a time), so it is
measured once over ``--hf-prompts`` prompts. ``--random-weights`` times a model built
at random from the given folder's config.json (for machines without the weights: the
speed of both sides does not depend on the values).

    radixray bench vs-hf --quantization w8a8_int8 --concurrency 1,32
    python -m radixray.bench.vs_hf --model cfg-folder --random-weights --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from radixray.bench import (
    ENGINE_FLAGS,
    add_engine_arguments,
    random_token_prompts,
    register,
    save_json,
    standalone_main,
)

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "generation_config.json")


def random_weight_copy(config_folder: str, out_folder: str, seed: int = 0) -> str:
    """A random-initialised model of ``config_folder``'s config.json (and its tokenizer files)
    saved as safetensors in ``out_folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_folder)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(
        out_folder, safe_serialization=True)
    for name in _TOKENIZER_FILES:
        if os.path.exists(os.path.join(config_folder, name)):
            shutil.copy(os.path.join(config_folder, name), out_folder)
    return out_folder


def time_engine(engine, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    """Seconds for ``prompts`` through ``engine`` with ``concurrency`` requests in flight."""
    from tqdm import tqdm
    params = {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}
    bar = tqdm(total=len(prompts), desc=f"radixray c={concurrency}", unit="req")

    def one(p):
        out = engine.generate(input_ids=p, sampling_params=params)
        bar.update(1)
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outs = list(pool.map(one, prompts))
    seconds = time.perf_counter() - t0
    bar.close()
    tokens = sum(len(o["output_ids"]) for o in outs)
    ttft = sorted(o["meta_info"]["first_token_latency"] for o in outs)
    engine.flush_cache()
    return {"concurrency": concurrency, "requests": len(prompts), "seconds": seconds,
            "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
            "median_ttft_s": ttft[len(ttft) // 2]}


def time_hf(model, prompts: list[list[int]], output_len: int) -> dict:
    """Seconds for ``prompts`` through ``model.generate``, one at a time (greedy, exactly
    ``output_len`` new tokens each)."""
    import torch
    from tqdm import tqdm

    tokens = 0
    t0 = time.perf_counter()
    for p in tqdm(prompts, desc="transformers generate, one at a time", unit="req"):
        ids = torch.tensor([p], device=model.device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=output_len, min_new_tokens=output_len,
                                 pad_token_id=0)
        tokens += out.shape[1] - len(p)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"requests": len(prompts), "seconds": seconds, "output_tokens": tokens,
            "output_tokens_per_s": tokens / seconds}


def run(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from radixray import Engine
    from radixray.engine.weights.loader import resolve_model

    levels = [int(c) for c in str(args.concurrency).split(",")]
    scratch = tempfile.mkdtemp(prefix="radixray-vs-hf-") if args.random_weights else None
    try:
        model = random_weight_copy(args.model, scratch) if scratch else args.model
        path = resolve_model(model).path
        pool = max(levels) * (args.input_len + args.output_len + 8) + 256
        engine = Engine(model=model, device=args.device, dtype=args.dtype,
                        quantization=args.quantization, quantize_lm_head=args.quantize_lm_head,
                        kv_cache_dtype=args.kv_cache_dtype, max_total_tokens=pool,
                        max_running_requests=max(levels))
        dtype = engine.model_facts().dtype
        prompts = random_token_prompts(args.num_prompts, args.input_len, engine.limits.vocab_size,
                                 args.seed)
        results: dict = {"model": args.model, "random_weights": bool(scratch),
                         "device": args.device, "dtype": str(dtype).removeprefix("torch."),
                         "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
                         "quantize_lm_head": args.quantize_lm_head, "threads": torch.get_num_threads(),
                         "input_len": args.input_len, "output_len": args.output_len, "radixray": []}
        try:
            time_engine(engine, prompts[:1], 4, 1)  # warm-up
            for c in levels:
                results["radixray"].append(time_engine(engine, prompts, args.output_len, c))
        finally:
            engine.shutdown()
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
        time_hf(hf, prompts[:1], 4)  # warm-up
        results["hf"] = time_hf(hf, prompts[:args.hf_prompts], args.output_len)
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    for r in results["radixray"]:
        r["x_hf"] = r["output_tokens_per_s"] / results["hf"]["output_tokens_per_s"]
    print_report(results)
    save_json(results, args.output)
    return results


def print_report(r: dict) -> None:
    hf = r["hf"]
    print(f"\nmodel={r['model']}{' (random weights)' if r['random_weights'] else ''} "
          f"device={r['device']} dtype={r['dtype']} quantization={r['quantization']} "
          f"kv_cache_dtype={r['kv_cache_dtype']} threads={r['threads']}, "
          f"{r['input_len']} in / {r['output_len']} out")
    print(f"transformers generate, one at a time: {hf['requests']} requests in {hf['seconds']:.1f} s, "
          f"{hf['output_tokens_per_s']:.1f} out tok/s")
    print(f"{'concurrency':>11} {'requests':>8} {'seconds':>8} {'out tok/s':>10} {'x HF':>6} "
          f"{'p50 TTFT s':>10}")
    for e in r["radixray"]:
        print(f"{e['concurrency']:>11} {e['requests']:>8} {e['seconds']:>8.1f} "
              f"{e['output_tokens_per_s']:>10.1f} {e['x_hf']:>6.1f} {e['median_ttft_s']:>10.2f}")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p, ENGINE_FLAGS + ("device",))  # the device of both sides
    p.add_argument("--random-weights", action="store_true",
                   help="time a random-initialised model of --model's config.json (a folder)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated, one engine run each")
    p.add_argument("--hf-prompts", type=int, default=8,
                   help="prompts timed through transformers (its rate is per request)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write results as JSON here")


def add_parser(bench_subparsers) -> None:
    """Register ``vs-hf`` on the ``radixray bench`` subparsers."""
    register(bench_subparsers, "vs-hf", "in-process: the engine at each concurrency vs transformers "
             "generate one at a time", _add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    return standalone_main(argv, "vs_hf", __doc__, _add_arguments, run, "INFO")


if __name__ == "__main__":
    raise SystemExit(main())
