"""``radixray bench hicache``: time to first token of an evicted conversation, by tier.

One engine with the hierarchical cache (write_through, a file storage tier in a temporary
folder) and one without it, over the same model. Per repeat, a new random ``--tokens``-long
conversation is sent four times, and each send's time to first token (the engine's
``first_token_latency``) is recorded:

* ``cold``: nothing cached; computed, and (write_through) copied to the host and storage
  tiers meanwhile;
* ``device``: again, from the KV pool;
* ``host``: after the KV pool evicted it, loaded back from the host tier;
* ``storage``: after the KV pool and the host tier dropped it, read back from the file
  tier (whole pages; the tail past the last page is computed);

and the engine without HiCache sends it once, after the same eviction: ``recompute``.
``--layout-check N`` instead compares N greedy tokens after a host hit with the computed
ones for each host layout (is fp8_e4m3 lossy enough to change the output?).

Medians over ``--repeats`` (after one short warm-up request per engine); every mode's
first token must equal the cold one.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile

from radixray.bench import add_engine_arguments

MODES = ("recompute", "cold", "device", "host", "storage")


def _ttft(eng, prompt: list[int]) -> tuple[float, int, int]:
    out = eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1,
                                                          "temperature": 0.0})
    meta = out["meta_info"]
    return meta["first_token_latency"], out["output_ids"][0], meta["cached_tokens"]


def _drop(eng, host: bool) -> None:
    """Evict every cached prefix from the KV pool (write_through keeps its host copy);
    with ``host`` the host tier's copies too."""
    eng.evict_cache(host_tier=host)


def run(model: str, tokens: int, repeats: int, engine_options: dict) -> dict:
    from radixray import Engine
    opts = dict(max_total_tokens=tokens + 512, context_length=tokens + 64, **engine_options)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    cached: dict[str, list[int]] = {m: [] for m in MODES}
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as folder, \
            Engine(model=model, enable_hierarchical_cache=True, hicache_storage_backend="file",
                   hicache_storage_dir=folder, **opts) as hi, \
            Engine(model=model, **opts) as plain:
        vocab = hi.limits.vocab_size
        for eng in (hi, plain):  # warm-up: first-call costs stay out of the figures
            _ttft(eng, [rng.randrange(10, vocab - 10) for _ in range(256)])
        for _ in range(repeats):
            prompt = [rng.randrange(10, vocab - 10) for _ in range(tokens)]
            firsts = {}
            for mode in MODES[1:]:
                if mode in ("host", "storage"):
                    _drop(hi, host=mode == "storage")
                t, first, c = _ttft(hi, prompt)
                times[mode].append(t)
                cached[mode].append(c)
                firsts[mode] = first
            _drop(plain, host=False)
            t, firsts["recompute"], c = _ttft(plain, prompt)
            times["recompute"].append(t)
            cached["recompute"].append(c)
            if len(set(firsts.values())) != 1:
                raise AssertionError(f"first tokens differ between tiers: {firsts}")
        stats = hi.snapshot().hicache
    result = {"model": model, "tokens": tokens, "repeats": repeats,
              "ttft_s": {m: statistics.median(v) for m, v in times.items()},
              "cached_tokens": {m: statistics.median(v) for m, v in cached.items()},
              "hicache": stats}
    for m in MODES:
        result[f"speedup_{m}_vs_recompute"] = result["ttft_s"]["recompute"] / result["ttft_s"][m]
    return result


def layout_check(model: str, tokens: int, new_tokens: int, engine_options: dict) -> dict:
    """Greedy tokens after a host-tier hit vs computed, per host layout (auto, fp8_e4m3):
    a prose prompt and a random one of ``tokens`` tokens each, evicted from the KV pool
    between the two sends."""
    from radixray import Engine
    greedy = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    out = {}
    for layout in ("auto", "fp8_e4m3"):
        with Engine(model=model, enable_hierarchical_cache=True, hicache_host_dtype=layout,
                    max_total_tokens=2 * tokens + 2 * new_tokens + 64, **engine_options) as eng:
            rng = random.Random(1)
            prose = eng.tokenizer(PROSE * (tokens // 20 + 1))["input_ids"][:tokens]
            noise = [rng.randrange(10, eng.limits.vocab_size - 10) for _ in range(tokens)]
            equal = []
            for prompt in (prose, noise):
                first = eng.generate(input_ids=prompt, sampling_params=greedy)["output_ids"]
                _drop(eng, host=False)
                again = eng.generate(input_ids=prompt, sampling_params=greedy)["output_ids"]
                equal.append(next((i for i, (a, b) in enumerate(zip(first, again)) if a != b),
                                  len(first)))
            tiers = eng.snapshot().hicache
            out[layout] = {"equal_prefix_tokens": equal,
                           "host_hit_tokens": tiers["host_hit_tokens"],
                           "host_bytes_per_token": tiers["host_bytes_per_token"]}
    return out


PROSE = ("The printing press spread across Europe within decades, and with it pamphlets, "
         "schedules, maps and the habit of reading in private. ")


def add_parser(sub) -> None:
    p = sub.add_parser("hicache", help="TTFT of an evicted conversation: host tier, storage "
                       "tier and recompute, side by side")
    add_engine_arguments(p, ("model", "dtype"))
    p.add_argument("--tokens", type=int, default=4096, help="conversation length")
    p.add_argument("--repeats", type=int, default=3, help="medians over this many")
    p.add_argument("--layout-check", type=int, default=0, metavar="NEW_TOKENS",
                   help="instead: greedy tokens after a host hit vs computed, for the auto "
                   "and fp8_e4m3 host layouts, this many new tokens")
    p.add_argument("--output", default=None, help="write the result as JSON here")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    opts = {"dtype": args.dtype}
    result = (layout_check(args.model, args.tokens, args.layout_check, opts)
              if args.layout_check else run(args.model, args.tokens, args.repeats, opts))
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 0
