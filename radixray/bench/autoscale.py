"""``radixray bench autoscale``: a fixed fleet against an autoscaled one under a step load.

Each fleet is started here (``radixray serve --config <fleet>.yaml`` on 127.0.0.1, a free
port), runs the same seeded step-load trace (:mod:`radixray.bench.load_steps`: quiet,
burst, quiet; open loop) while its ``/metrics`` is sampled every second
(:mod:`radixray.bench.fleet_sampler`), and is stopped before the next one starts:

- unified: a fixed 1-worker fleet, then one autoscaled between 1 and 2 workers
  (``target_ongoing_requests``);
- pd: a fixed 1 prefill + 1 decode fleet, then one whose prefill and decode roles each
  scale 1..2 against the SLOs (``server.slo_ttft_s`` / ``slo_tpot_s``, from
  ``--slo-ttft-ms`` / ``--slo-tpot-ms``) and their queue and KV targets.

Every fleet of a pair has the same engine (``--model``, default ``default``), the same
threads per worker and CPUs reserved per worker (a worker is one unit of the machine: its
cores divided by the pair's largest fleet), the same running-request cap and the same
queue bound (``server.max_queued_requests``: past it a worker answers 503), and the
router's ``least_load`` policy. The autoscaler runs with benchmark-length delays (the
flags; printed with the results). Result: one table (burst p99 TTFT, burst 503s, other
failures, output tok/s, worker-seconds, most workers), ``--output-json`` and ``--plot``
(workers and TTFT over time per fleet). Each fleet's config and server log go to
``--output-dir``.

Example (issue 39's figure; docs/benchmarks.md)::

    radixray bench autoscale --output-json autoscale.json --plot autoscale.png
    radixray bench autoscale --only unified --load-steps 10s@0.2,20s@2,20s@0.2
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from radixray.bench import datasets, json_safe, launch, load_steps
from radixray.bench.stream_client import ENDPOINTS, ServerUnreachable, get_model_id

KINDS = ("unified", "pd")
UNIFIED_STEPS = "20s@0.2,60s@2.5,70s@0.2"
PD_STEPS = "20s@0.2,60s@3,70s@0.2"
TIMING_FLAGS = ("upscale_delay_s", "downscale_delay_s", "decision_interval_s",
                "look_back_period_s", "drain_timeout_s")


def most_workers(kind: str) -> int:
    """Workers the larger fleet of a pair can reach: 2 unified, 2 prefill + 2 decode."""
    return 2 if kind == "unified" else 4


def worker_share(args: argparse.Namespace, kind: str) -> tuple[int, float]:
    """(torch threads, Ray CPUs) of each worker of ``kind``'s pair: this machine's cores
    split by the pair's largest fleet, at least one thread (``--worker-threads`` sets
    the threads)."""
    cpus = os.cpu_count() or 1
    threads = args.worker_threads or max(1, cpus // most_workers(kind))
    return threads, min(1.0, cpus / most_workers(kind))


def autoscaling_timing(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in TIMING_FLAGS}


def fleet_configs(args: argparse.Namespace, kind: str) -> dict[str, dict]:
    """The pair of ``radixray serve`` configs (name -> ServeConfig dict) of ``kind``:
    fixed first, then autoscaled; identical but for ``fleet``."""
    threads, cpus = worker_share(args, kind)
    engine = {"model": args.model, "max_total_tokens": args.max_total_tokens,
              "max_running_requests": args.max_running_requests, "num_threads": threads}
    server = {"worker_num_cpus": cpus, "max_queued_requests": args.max_queued_requests}
    base = {"engine": engine, "server": server, "router": {"policy": "least_load"}}
    scaling = autoscaling_timing(args)
    if kind == "unified":
        fixed = {"workers": 1}
        scaled = {"workers": 1, "autoscaling": {
            "min_workers": 1, "max_workers": 2,
            "target_ongoing_requests": args.target_ongoing_requests, **scaling}}
    else:
        server.update(slo_ttft_s=args.slo_ttft_ms / 1000, slo_tpot_s=args.slo_tpot_ms / 1000)
        engine.update(disaggregation_bootstrap_timeout_s=300,
                      disaggregation_waiting_timeout_s=300)
        fixed = {"prefill_workers": 1, "decode_workers": 1}
        scaled = {**fixed, "autoscaling": {**scaling,
                                           "prefill": {"min_workers": 1, "max_workers": 2},
                                           "decode": {"min_workers": 1, "max_workers": 2}}}
    return {f"{kind}-fixed": {**base, "fleet": fixed},
            f"{kind}-autoscaled": {**base, "fleet": scaled}}


def check_configs(configs: dict[str, dict]) -> None:
    """ValueError (the config's own message, naming the field) when a fleet's config does
    not validate; checked before any server starts."""
    from radixray.cluster.config import ConfigError, ServeConfig
    for name, config in configs.items():
        try:
            ServeConfig.parse(config)
        except ConfigError as e:
            raise ValueError(f"{name}: {e}") from None


def run_fleet(name: str, config: dict, steps: list, args: argparse.Namespace,
              tokenizer) -> dict:
    """Start one fleet, run the trace against it, stop it; the trace's summary with the
    fleet's ``name``, ``kind``, ``config``, ``url``, start-up seconds and log path."""
    import yaml
    path = os.path.join(args.output_dir, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    port = launch.free_port()
    command = launch.radixray_command(port, ["--config", path])
    log = os.path.join(args.output_dir, f"{name}.log")
    with launch.started(name, command, port, "/ready", log, args.startup_timeout) as server:
        model = get_model_id(server.url)
        trace = argparse.Namespace(**{**vars(args), "load_steps": steps})
        summary = load_steps.run_steps(trace, name, server.url, model, tokenizer)
        summary.update(fleet=name, kind=name.split("-")[0], config=config, url=server.url,
                       startup_s=server.startup_s, log=log)
    return summary


def describe(args: argparse.Namespace, kinds: list[str]) -> str:
    """The settings every fleet ran with, in a few lines."""
    steps = {kind: load_steps.format_load_steps(args.steps[kind]) for kind in kinds}
    shares = {kind: worker_share(args, kind) for kind in kinds}
    def span(length: int) -> str:
        return f"{max(int(length * args.random_range_ratio), 1)}-{length}"
    lines = [f"trace: {', '.join(f'{k} {v}' for k, v in steps.items())} (duration@requests/s, "
             f"Poisson, open loop, seed {args.seed}); random prompts of "
             f"{span(args.random_input_len)} tokens, {span(args.random_output_len)} out",
             f"model {args.model}; per worker: " + ", ".join(
                 f"{k} {t} thread(s) / {c:g} CPU" for k, (t, c) in shares.items())
             + f"; max_running_requests {args.max_running_requests}, max_queued_requests "
             f"{args.max_queued_requests} (503 beyond), max_total_tokens {args.max_total_tokens}"
             "; router least_load"]
    scaling = [", ".join(f"{k} {v:g}" for k, v in autoscaling_timing(args).items())]
    if "unified" in kinds:
        scaling.append(f"unified 1..2 at target_ongoing_requests {args.target_ongoing_requests:g}")
    if "pd" in kinds:
        scaling.append(f"pd prefill 1..2 and decode 1..2 at slo_ttft_s "
                       f"{args.slo_ttft_ms / 1000:g}, slo_tpot_s {args.slo_tpot_ms / 1000:g}")
    return "\n".join(lines + ["autoscaling: " + "; ".join(scaling)])


def run_autoscale(args: argparse.Namespace) -> int:
    """Every fleet of the chosen pairs in turn, then the table, JSON and plot; 0 when all
    ran, 1 when a server did not start or answer, 2 on bad flags (nothing started)."""
    from radixray.bench import autoscale_report
    from radixray.bench.compare_report import git_commit, host_info
    kinds = list(KINDS) if args.only is None else [args.only]
    args.steps = {"unified": args.load_steps, "pd": args.pd_load_steps}
    try:
        configs = {kind: fleet_configs(args, kind) for kind in kinds}
        for kind in kinds:
            check_configs(configs[kind])
            load_steps.check_trace_args(argparse.Namespace(**{**vars(args), "load_steps":
                                                              args.steps[kind]}))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.output_dir, exist_ok=True)
    settings = describe(args, kinds)
    print(settings, flush=True)
    tokenizer = datasets.load_tokenizer(args.tokenizer)
    fleets = []
    try:
        for kind in kinds:
            for name, config in configs[kind].items():  # one after the other, never together
                fleets.append(run_fleet(name, config, args.steps[kind], args, tokenizer))
    except (ServerUnreachable, launch.ServerFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    argv = getattr(args, "argv", None) or ["bench", "autoscale"]
    report = {"command": "radixray " + shlex.join(argv), "commit": git_commit(),
              "host": host_info(), "settings": settings, "fleets": fleets,
              "table": autoscale_report.table_rows(fleets)}
    print("\n" + settings + "\n" + autoscale_report.format_table(report["table"]), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(json_safe(report), f, indent=2)
        print(f"written: {args.output_json}", flush=True)
    if args.plot:
        print(f"plot: {autoscale_report.plot_autoscale(fleets, args.plot)}", flush=True)
    return 0


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """The client's flags: the random prompts (input uniform in [len x ratio, len], the
    same for the output), the SLOs, the rest as ``bench serve`` has them."""
    g = p.add_argument_group("requests (random prompts; ignore_eos, temperature 0)")
    g.add_argument("--api", default="completions", choices=sorted(ENDPOINTS))
    g.add_argument("--tokenizer", default="default", help="as in bench serve")
    g.add_argument("--random-input-len", type=int, default=512)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.5,
                   help="lengths are uniform integers in [int(len*ratio), len]")
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--warmup", type=int, default=1, help="requests sent first, left out")
    g.add_argument("--slo-ttft-ms", type=float, default=2000.0,
                   help="TTFT SLO: the pd fleets' server.slo_ttft_s, and every fleet's goodput")
    g.add_argument("--slo-tpot-ms", type=float, default=100.0,
                   help="TPOT SLO: the pd fleets' server.slo_tpot_s, and every fleet's goodput")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a stream may stay silent before the request fails")
    g.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(dataset="random", sweep=None, ignore_eos=True, temperature=0.0)


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Add the ``autoscale`` subcommand; its ``func`` is :func:`run_autoscale`."""
    p = bench_subparsers.add_parser(
        "autoscale", help="a fixed fleet against an autoscaled one under a step load "
        "(unified and prefill-decode): TTFT, 503s, worker-seconds",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=KINDS, default=None, help="run one pair (default: both)")
    load_steps.add_load_steps_arg(p, UNIFIED_STEPS, help="the unified pair's trace")
    p.add_argument("--pd-load-steps", type=load_steps.steps_arg,
                   default=load_steps.parse_load_steps(PD_STEPS), metavar="Ds@R,...",
                   help=f"the prefill-decode pair's trace (default {PD_STEPS}; two workers "
                   "take a larger burst)")
    add_trace_args(p)
    g = p.add_argument_group("fleets (every fleet of a pair alike)")
    g.add_argument("--model", default="default", help="engine.model of every fleet")
    g.add_argument("--max-running-requests", type=int, default=16,
                   help="engine.max_running_requests: requests a worker decodes together")
    g.add_argument("--max-queued-requests", type=int, default=8,
                   help="server.max_queued_requests: past this many waiting, a worker "
                   "answers 503")
    g.add_argument("--max-total-tokens", type=int, default=32768, help="engine.max_total_tokens")
    g.add_argument("--worker-threads", type=int, default=None,
                   help="engine.num_threads (default: cores / the pair's most workers, >= 1)")
    g = p.add_argument_group("autoscaling (benchmark-length delays)")
    g.add_argument("--target-ongoing-requests", type=float, default=4.0,
                   help="unified: in-flight requests per worker")
    g.add_argument("--upscale-delay-s", type=float, default=5.0)
    g.add_argument("--downscale-delay-s", type=float, default=20.0)
    g.add_argument("--decision-interval-s", type=float, default=1.0)
    g.add_argument("--look-back-period-s", type=float, default=10.0)
    g.add_argument("--drain-timeout-s", type=float, default=60.0)
    p.add_argument("--startup-timeout", type=float, default=1800.0,
                   help="seconds a fleet may take to answer /ready")
    p.add_argument("--output-dir", default="bench_autoscale",
                   help="where each fleet's config and server log go")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="a PNG: workers and TTFT over time per fleet")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(func=run_autoscale)
    return p
