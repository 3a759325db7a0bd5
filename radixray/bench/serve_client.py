"""``radixray bench serve``: a streaming load generator for any OpenAI-compatible server.

Sends a workload from :mod:`radixray.bench.datasets` to ``/v1/completions`` or
``/v1/chat/completions`` through the streaming client (:mod:`radixray.bench.stream_client`:
TTFT, every inter-token gap, E2E latency and the token counts the server reports per
request); :mod:`radixray.bench.serve_metrics` aggregates them. ``--load-steps`` runs a
step-load trace instead (:mod:`radixray.bench.load_steps`). Several servers
(``--target LABEL=URL``) and several concurrency limits (``--sweep``) run one
after another in the same invocation, each on a fresh copy of the same seeded
workload.

Example::

    radixray bench serve --target radixray=http://127.0.0.1:8000 \\
        --target naive=http://127.0.0.1:8001 --dataset shared-prefix --sweep 1,8,32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys

from radixray.bench import datasets, json_safe, load_steps, server_side
from radixray.bench.serve_metrics import format_summary, format_sweep_table, summarize
from radixray.bench.stream_client import (
    ENDPOINTS,
    RunConfig,
    ServerUnreachable,
    get_model_id,
    run_benchmark,
)
from radixray.cluster.routing import POLICIES


def _target(value: str) -> tuple[str, str]:
    label, sep, url = value.partition("=")
    if not sep or not label or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"--target: expected LABEL=http(s)://HOST:PORT, got {value!r}")
    return label, url


def _int_list(value: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"--sweep: expected positive integers like 1,8,32, got {value!r}")
    return out


def sweep_points(args: argparse.Namespace) -> list[tuple[int | None, int | None]]:
    """(max concurrency, prompt count) of each run of ``args``'s sweep, in order.

    Raises ValueError when ``--sweep-num-prompts`` does not give one count per ``--sweep`` value.
    """
    concurrencies = args.sweep or [getattr(args, "max_concurrency", None)]
    prompt_counts = args.sweep_num_prompts or [args.num_prompts] * len(concurrencies)
    if len(prompt_counts) != len(concurrencies):
        raise ValueError("--sweep-num-prompts needs one count per --sweep value")
    return list(zip(concurrencies, prompt_counts))


def run_sweep(args: argparse.Namespace, label: str, url: str, model: str, tokenizer, *,
              policy: str | None = None, loopback: float | None = None, jsonl=None) -> list[dict]:
    """Every point of :func:`sweep_points` against one server; one summary per point.

    The same ``args``, seed and tokenizer give every server the same prompts. Each
    summary is printed as it completes; ``jsonl`` (an open file) gets one line per request.
    With ``--load-steps``, the one summary of that trace (:func:`load_steps.run_steps`).
    """
    if getattr(args, "load_steps", None):  # one step-load trace instead of a sweep
        return [load_steps.run_steps(args, label, url, model, tokenizer, jsonl=jsonl)]

    def count(text: str) -> int:
        return datasets.count_tokens(tokenizer, text)

    slo = dict(slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
    summaries = []
    for point, (conc, num) in enumerate(sweep_points(args)):
        if policy is not None:
            server_side.prepare_policy_run(url, policy)
        items, warm_items = datasets.sweep_point(args, point, num, tokenizer)
        cfg = RunConfig(base_url=url, model=model, api=args.api, label=label,
                        max_concurrency=conc, request_rate=args.request_rate,
                        seed=args.seed, warmup=args.warmup, ignore_eos=args.ignore_eos,
                        temperature=args.temperature, request_timeout=args.request_timeout,
                        progress=not args.disable_tqdm, session_header=args.session_header)
        before = server_side.scrape(url)
        records, duration = asyncio.run(run_benchmark(cfg, items, count, warm_items))
        summary = summarize(records, duration, label=label, request_rate=args.request_rate,
                            max_concurrency=conc, **slo)
        summary.update(server_side.run_delta(before, server_side.scrape(url)))
        if args.dataset == "interference":
            from radixray.bench import interference
            summary.update(interference.class_stats(records, {it.index: it.group for it in items}))
            summary.update(interference.transfer_fields(summary, loopback))
        if policy is not None:
            summary["router_policy"] = policy
        summaries.append(summary)
        print(format_summary(summary), flush=True)
        if jsonl:
            jsonl.writelines(json.dumps(r.to_json()) + "\n" for r in records)
            jsonl.flush()
    return summaries


def run_serve_bench(args: argparse.Namespace) -> int:
    """Run every (target, concurrency) pair of ``args`` in turn; print and write the results.

    Returns 0 once the runs finished (failed requests included) and 1 when a
    target does not answer at the start.
    """
    targets = args.target or [(args.base_url, args.base_url)]
    if args.router_policy:  # one run per (target, policy), each from a cold cache
        targets = [(f"{label}:{p}" if len(targets) > 1 else p, url, p)
                   for label, url in targets for p in args.router_policy]
    else:
        targets = [(label, url, None) for label, url in targets]
    try:
        sweep_points(args)
        if args.load_steps:
            load_steps.check_trace_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        models = {label: get_model_id(url, args.model) for label, url, _ in targets}
    except ServerUnreachable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tokenizer = datasets.load_tokenizer(args.tokenizer)
    loopback = None
    if args.loopback_tcp:
        from radixray.bench.loopback import tcp_loopback_rate
        loopback = tcp_loopback_rate()
        print(f"loopback TCP rate: {loopback / 1e9:.2f} GB/s", flush=True)
    summaries = []
    sink = open(args.output_jsonl, "w") if args.output_jsonl else contextlib.nullcontext()
    with sink as jsonl:
        for label, url, policy in targets:
            summaries += run_sweep(args, label, url, models[label], tokenizer, policy=policy,
                                   loopback=loopback, jsonl=jsonl)
    if loopback is not None:  # again at the end: the rate drifts on a shared host
        from radixray.bench import interference
        from radixray.bench.loopback import tcp_loopback_rate
        again = tcp_loopback_rate()
        print(f"loopback TCP rate at the end: {again / 1e9:.2f} GB/s", flush=True)
        for summary in summaries:
            summary["loopback_tcp_gb_s_runs"] = [loopback / 1e9, again / 1e9]
            summary.update(interference.transfer_fields(summary, max(loopback, again)))
    if args.dataset == "interference":
        from radixray.bench.interference import format_table
        print(format_table(summaries))
    elif len(summaries) > 1:
        print(format_sweep_table(summaries))
    if args.sweep:
        from radixray.bench.sweep_plot import plot_sweep
        print(f"sweep plot: {plot_sweep(summaries, args.plot)}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(json_safe(summaries), f, indent=2)
    return 0


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The client's flags that ``bench serve`` and ``bench compare`` share: API, tokenizer,
    dataset, arrivals, sampling, SLOs and the sweep."""
    p.add_argument("--api", default="completions", choices=sorted(ENDPOINTS))
    p.add_argument("--tokenizer", default="default",
                   help="'default' (radixray's default model) or a model/tokenizer folder; "
                        "builds prompts of exact token lengths and counts unreported tokens")
    datasets.add_dataset_args(p)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="conversation arrivals per second, Poisson (default inf: all at once)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1, help="requests sent first and left out of the results")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so every output has exactly max_tokens tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--request-timeout", type=float, default=3600.0,
                   help="seconds a stream may stay silent before the request fails")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT SLO for goodput")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT SLO for goodput")
    p.add_argument("--sweep", type=_int_list, default=None, metavar="C1,C2,...",
                   help="run once per max-concurrency value")
    p.add_argument("--sweep-num-prompts", type=_int_list, default=None, metavar="N1,N2,...",
                   help="random dataset: prompts per --sweep point (default --num-prompts each)")
    p.add_argument("--session-header", action=argparse.BooleanOptionalAction, default=True,
                   help="multi-turn: send X-Session-Id with each turn")
    p.add_argument("--disable-tqdm", action="store_true")


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to ``bench_subparsers``; its ``func`` is :func:`run_serve_bench`."""
    p = bench_subparsers.add_parser(
        "serve", help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, throughput)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--target", type=_target, action="append", metavar="LABEL=URL",
                   help="a server to benchmark (repeatable; runs one after another); overrides --base-url")
    p.add_argument("--model", default=None, help="model id to send (default: first id of GET /v1/models)")
    add_workload_args(p)
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight (default: no limit)")
    load_steps.add_load_steps_arg(p)
    p.add_argument("--plot", default="bench_sweep.png", help="PNG written by --sweep")
    p.add_argument("--output-jsonl", default=None, help="one JSON line per request")
    p.add_argument("--output-json", default=None, help="a JSON list of the run summaries")
    p.add_argument("--router-policy", action="append", default=None,
                   choices=POLICIES,
                   help="radixray fleets: run once per policy (repeat the flag), switching the "
                   "router and flushing the caches before each run")
    p.add_argument("--loopback-tcp", action="store_true", help="measure this machine's loopback "
                   "TCP rate first, and report KV transfer rates as a share of it")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(func=run_serve_bench)
    return p
