"""``radixray bench compare``: one serving sweep against radixray, then against llama-server.

The same client (:mod:`radixray.bench.stream_client`), the same seeded prompts and
the same metrics for both servers, one after the other, each alone on the
machine; then one table (output tok/s per concurrency, p50 TPOT, p50 TTFT, max
ITL, and the ratios radixray / llama-server) with the host's CPU and flags, the
commit and the exact command, printed and written to ``--output-dir`` as
``compare.md``, ``compare.json`` and ``compare.png``. Each server is either
already running (``--radixray-url``, ``--llama-server-url``) or started here on
127.0.0.1 and stopped afterwards: radixray as ``make run`` starts it (plus
``--radixray-args``), llama-server from ``--llama-server-bin`` (or ``llama-server``
on PATH) with ``--llama-gguf``. Both are asked through ``/v1/completions`` (or
``/v1/chat/completions`` with ``--api chat``) with the same texts; a few probe
prompts check that both servers count them as the same number of tokens. Without
``--sweep`` the sweep is the issue's: random prompts of 512 tokens, 128 out,
concurrency 1, 8, 32 with 6, 16, 32 prompts. ``--rounds N`` runs the pair N times,
each round with prompts of its own seed and the other server first, and reports
each figure's median and each ratio's median over the rounds (a noisy host moves one
pair by more than the gap being measured).

Example (the issue's sweep; docs/benchmarks.md, "radixray vs llama-server")::

    radixray bench compare --llama-gguf /work/llama-models/smollm2-135m-instruct-f16.gguf
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import shutil
import sys

from radixray.bench import datasets, json_safe, launch
from radixray.bench.compare_report import (
    comparison,
    git_commit,
    host_info,
    markdown_report,
    median_summaries,
    rounds_comparison,
)
from radixray.bench.serve_client import add_workload_args, run_sweep, sweep_points
from radixray.bench.stream_client import (
    ENDPOINTS,
    ServerUnreachable,
    build_prompt,
    get_model_id,
    request_body,
    stream_request,
)

RADIXRAY, LLAMA = "radixray", "llama-server"
DEFAULT_SWEEP, DEFAULT_SWEEP_PROMPTS = (1, 8, 32), (6, 16, 32)
PROBE_PROMPTS = 3
PROBE_SEED_OFFSET = 10_000  # probe prompts are not among the measured ones (a prefix cache)
PROMPT_TOKENS_TOLERANCE = 0.02
ROUND_SEED_STEP = 1_000  # round r's prompts come from seed + r * this: no prefix-cache hits
DOCS = ("docs/benchmarks.md, \"radixray vs llama-server\", says how to build llama-server "
        "and make the F16 GGUF.")
HOW_TO_GET_LLAMA = (
    "Either pass --llama-server-url http://127.0.0.1:PORT (a llama-server already running), "
    "or --llama-gguf PATH.gguf (or 'default', the GGUF radixray's default model comes from) "
    "so that bench compare starts llama-server itself, found on PATH or given by "
    "--llama-server-bin PATH. " + DOCS)


class UsageError(ValueError):
    """Flags that cannot work together or point at nothing; the message names the flags."""


def _split(flag: str, value: str) -> list[str]:
    extra = shlex.split(value or "")
    clash = [a for a in extra if a.split("=")[0] in ("--host", "--port")]
    if clash:
        raise UsageError(f"{flag}: leave out {' '.join(clash)}; bench compare picks the host "
                         "(127.0.0.1) and a free port")
    return extra


def apply_sweep_defaults(args: argparse.Namespace) -> None:
    """The issue's sweep when ``--sweep`` is left out: concurrency 1, 8, 32 with 6, 16, 32
    prompts. A ``--sweep`` of the random dataset needs its prompt counts too."""
    if args.sweep is None:
        args.sweep = list(DEFAULT_SWEEP)
        if args.sweep_num_prompts is None and args.num_prompts is None:
            args.sweep_num_prompts = list(DEFAULT_SWEEP_PROMPTS)
    elif args.dataset == "random" and args.sweep_num_prompts is None and args.num_prompts is None:
        raise UsageError("--sweep: give the prompts of each point too, --sweep-num-prompts "
                         "N1,N2,... (one per --sweep value) or --num-prompts N")
    if getattr(args, "rounds", 1) < 1:
        raise UsageError(f"--rounds: {args.rounds} is below 1; give 1 or more rounds")


def plan_llama(args: argparse.Namespace) -> dict:
    """How to reach llama-server: ``{"url": ...}`` or ``{"binary", "gguf", "extra"}``.

    Raises :class:`UsageError` (naming the flags, and what to do) when neither a URL
    nor a binary and a GGUF are available.
    """
    starting = args.llama_gguf or args.llama_server_bin or args.llama_args
    if args.llama_server_url:
        if starting:
            raise UsageError("--llama-server-url uses a running llama-server; leave out "
                             "--llama-gguf, --llama-server-bin and --llama-args (or drop the URL "
                             "so that bench compare starts one)")
        return {"url": args.llama_server_url}
    if not args.llama_gguf:
        raise UsageError("no llama-server to compare with. " + HOW_TO_GET_LLAMA)
    gguf = args.llama_gguf
    if gguf == "default":
        from radixray.engine.weights.loader import default_model_path
        gguf = default_model_path()
    if not os.path.isfile(gguf):
        raise UsageError(f"--llama-gguf: no file {gguf}. " + HOW_TO_GET_LLAMA)
    binary = args.llama_server_bin or shutil.which("llama-server")
    if binary is None:
        raise UsageError("llama-server is not on PATH: pass --llama-server-bin PATH (or "
                         "--llama-server-url of a running one). " + DOCS)
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        raise UsageError(f"--llama-server-bin: {binary} is not an executable file")
    return {"binary": binary, "gguf": os.path.abspath(gguf),
            "extra": _split("--llama-args", args.llama_args)}


def plan_radixray(args: argparse.Namespace) -> dict:
    """How to reach radixray: ``{"url": ...}`` or ``{"extra": serve flags}``."""
    if args.radixray_url:
        if args.radixray_args:
            raise UsageError("--radixray-args applies only when bench compare starts radixray; "
                             "leave out --radixray-url (or start it with those flags yourself)")
        return {"url": args.radixray_url}
    return {"extra": _split("--radixray-args", args.radixray_args)}


def tokens_per_request(args: argparse.Namespace) -> int:
    """The most tokens one request of the workload holds (prompt + output): a slot's size."""
    if args.dataset == "shared-prefix":
        return args.gsp_system_prompt_len + args.gsp_question_len + args.gsp_output_len
    if args.dataset == "multi-turn":
        return args.multiturn_turns * (args.multiturn_turn_len + args.multiturn_output_len)
    if args.dataset == "interference":
        return max(args.interference_long_len + args.interference_long_output_len,
                   args.interference_short_len + args.interference_short_output_len)
    return args.random_input_len + args.random_output_len


def describe_workload(args: argparse.Namespace) -> str:
    """One line: dataset and its lengths, API, sweep points, seed, warm-up requests."""
    points = sweep_points(args)
    sweep = ", ".join(f"c={c or 'inf'} x {n if n is not None else 'dataset'}" for c, n in points)
    data = args.dataset
    if data == "random":
        data += (f" {args.random_input_len} in / {args.random_output_len} out "
                 f"(range ratio {args.random_range_ratio:g})")
    rounds = getattr(args, "rounds", 1)
    seed = f"seed {args.seed}" + (f" (+{ROUND_SEED_STEP:,} each round, {rounds} rounds)"
                                  if rounds > 1 else "")
    return (f"{data}; {ENDPOINTS[args.api]}; sweep {sweep} "
            f"(concurrency x prompts); {seed}; {args.warmup} warm-up request(s) per point")


def probe_texts(args: argparse.Namespace, tokenizer) -> list:
    """A few prompts of the workload's shape, seeded apart from every measured one."""
    probe = argparse.Namespace(**{**vars(args), "seed": args.seed + PROBE_SEED_OFFSET,
                                  "num_prompts": PROBE_PROMPTS})
    items = datasets.build_from_args(probe, tokenizer)[:PROBE_PROMPTS]
    return [build_prompt(args.api, item, 0, []) for item in items]


async def _probe(label: str, url: str, model: str, api: str, prompts: list) -> list[int | None]:
    """Each prompt's ``usage.prompt_tokens`` from a one-token request; None where the
    server did not report it or the request failed (said on stderr)."""
    import httpx
    endpoint = url.rstrip("/") + ENDPOINTS[api]
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0)) as client:
        outs = [await stream_request(client, endpoint, request_body(api, model, p, 1))
                for p in prompts]
    for out in outs:
        if not out.success:
            print(f"warning: a {label} probe request failed: {out.error}", file=sys.stderr)
    return [o.prompt_tokens for o in outs]


def prompt_tokens_agree(counts: list[list[int | None]]) -> bool:
    """Every server reported every probe and no two counts of a prompt differ by more
    than :data:`PROMPT_TOKENS_TOLERANCE`."""
    for per_prompt in zip(*counts):
        if any(n is None for n in per_prompt):
            return False
        if max(per_prompt) - min(per_prompt) > PROMPT_TOKENS_TOLERANCE * max(per_prompt):
            return False
    return True


@contextlib.contextmanager
def reach(label: str, plan: dict, args: argparse.Namespace):
    """Yield (base URL, :class:`launch.StartedServer` or None) of one side: the given URL, or
    a server started on 127.0.0.1 (log in ``--output-dir``) and stopped on the way out."""
    if "url" in plan:
        yield plan["url"], None
        return
    port = launch.free_port()
    if label == RADIXRAY:
        command, ready = launch.radixray_command(port, plan["extra"]), "/ready"
    else:
        parallel = args.llama_parallel or max(c or 1 for c, _ in sweep_points(args))
        ctx = args.llama_ctx_size or launch.llama_ctx_size(parallel, tokens_per_request(args))
        command = launch.llama_server_command(plan["binary"], plan["gguf"], port,
                                              args.llama_threads, parallel, ctx, plan["extra"])
        ready = "/health"
    log = os.path.join(args.output_dir, f"{label}.log")
    with launch.started(label, command, port, ready, log, args.startup_timeout) as server:
        yield server.url, server


def _version(url: str) -> str | None:
    """llama-server's build (``GET /props``); None when the server does not say."""
    import httpx
    try:
        props = httpx.get(url.rstrip("/") + "/props", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return None
    info = props.get("build_info") if isinstance(props, dict) else None
    return str(info) if info else None


def run_side(label: str, plan: dict, args: argparse.Namespace, tokenizer,
             probes: list) -> dict:
    """Reach (or start) one server, probe its prompt token counts, run the sweep, stop it."""
    with reach(label, plan, args) as (url, server):
        model = get_model_id(url)
        counts = asyncio.run(_probe(label, url, model, args.api, probes))
        summaries = run_sweep(args, label, url, model, tokenizer)
        return {"url": url, "model": model, "command": server.command if server else None,
                "log": server.log_path if server else None,
                "startup_s": server.startup_s if server else None,
                "version": _version(url) if label == LLAMA else None,
                "probe_prompt_tokens": counts, "summaries": summaries}


def run_rounds(plans: dict, args: argparse.Namespace, tokenizer, probes: list) -> list[dict]:
    """``--rounds`` rounds of both sides, one server after the other. Round r (from 0) uses
    the prompts of seed ``args.seed + r * ROUND_SEED_STEP`` for both servers and starts
    with the first server on even rounds, the second on odd ones. Returns per round
    ``{"seed", "order", "servers": {label: run_side(...)}}`` (labels in ``plans`` order)."""
    rounds = []
    labels = list(plans)
    for r in range(args.rounds):
        seed = args.seed + r * ROUND_SEED_STEP
        order = labels if r % 2 == 0 else labels[::-1]
        round_args = argparse.Namespace(**{**vars(args), "seed": seed})
        ran = {label: run_side(label, plans[label], round_args, tokenizer, probes)
               for label in order}
        rounds.append({"seed": seed, "order": order, "servers": {k: ran[k] for k in labels}})
        if args.rounds > 1:
            comp = comparison({k: ran[k]["summaries"] for k in labels})
            last = comp["concurrencies"][-1]
            figs = " vs ".join(f"{k} {comp['servers'][k][last]['output_tok_s'] or 0:.1f}"
                               for k in labels)
            print(f"round {r + 1} of {args.rounds} (seed {seed}, {order[0]} first): c={last} "
                  f"{figs} tok/s", flush=True)
    return rounds


def run_compare(args: argparse.Namespace) -> int:
    """Both sweeps, then the table; 0 when both ran, 1 when a server did not answer or start,
    2 on bad flags (nothing started)."""
    try:
        apply_sweep_defaults(args)
        sweep_points(args)
        plans = {RADIXRAY: plan_radixray(args), LLAMA: plan_llama(args)}
    except (UsageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.output_dir, exist_ok=True)
    tokenizer = datasets.load_tokenizer(args.tokenizer)
    probes = probe_texts(args, tokenizer)
    client_counts = [datasets.count_tokens(tokenizer, p if isinstance(p, str) else
                                           "".join(m["content"] for m in p)) for p in probes]
    try:
        rounds = run_rounds(plans, args, tokenizer, probes)
    except (ServerUnreachable, launch.ServerFailed) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    sweeps = [{k: v["summaries"] for k, v in r["servers"].items()} for r in rounds]
    comp = rounds_comparison(sweeps)  # one round: its own figures and ratios
    # every round's requests count in the failed totals
    servers = {k: {**v, "summaries": [s for sweep in sweeps for s in sweep[k]]}
               for k, v in rounds[0]["servers"].items()}
    argv = getattr(args, "argv", None) or ["bench", "compare"]
    report = {
        "command": "radixray " + shlex.join(argv),
        "commit": git_commit(),
        "host": host_info(),
        "workload": describe_workload(args),
        "comparison": comp,
        "rounds": [{"seed": r["seed"], "order": r["order"]} for r in rounds],
        "prompt_check": {"client": client_counts,
                         "servers": {k: v["probe_prompt_tokens"] for k, v in servers.items()},
                         "agree": prompt_tokens_agree([v["probe_prompt_tokens"]
                                                       for v in servers.values()])},
        "servers": servers,
    }
    text = markdown_report(report)
    paths = {ext: os.path.join(args.output_dir, f"compare.{ext}") for ext in ("md", "json", "png")}
    with open(paths["md"], "w") as f:
        f.write(text)
    with open(paths["json"], "w") as f:
        json.dump(json_safe(report), f, indent=2)
    from radixray.bench.sweep_plot import plot_sweep
    plot_sweep([s for label in servers for s in median_summaries([sw[label] for sw in sweeps])],
               paths["png"])
    print("\n" + text, flush=True)
    print(f"written: {paths['md']}, {paths['json']}, {paths['png']}", flush=True)
    if not report["prompt_check"]["agree"]:
        print("warning: the servers count the probe prompts differently (see above); their "
              "tokenizers or templates differ", file=sys.stderr)
    return 0


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Add the ``compare`` subcommand to ``bench_subparsers``; its ``func`` is :func:`run_compare`."""
    p = bench_subparsers.add_parser(
        "compare", help="the same serving sweep against radixray and llama-server, one table",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("radixray")
    g.add_argument("--radixray-url", default=None,
                   help="a running radixray (default: start `radixray serve` as `make run` does)")
    g.add_argument("--radixray-args", default="",
                   help="extra `radixray serve` flags when starting it, one quoted string "
                        "(e.g. \"--quantization w8a8_int8 --kv-cache-dtype fp8_e5m2\")")
    g = p.add_argument_group("llama-server")
    g.add_argument("--llama-server-url", default=None, help="a running llama-server")
    g.add_argument("--llama-server-bin", default=None,
                   help="the llama-server to start (default: llama-server on PATH)")
    g.add_argument("--llama-gguf", default=None,
                   help="the GGUF llama-server serves; 'default' is the Q4_1 file radixray's "
                        "default model comes from")
    g.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1,
                   help="llama-server -t (default: this machine's CPU count)")
    g.add_argument("--llama-parallel", type=int, default=None,
                   help="llama-server -np, its slots (default: the largest --sweep value)")
    g.add_argument("--llama-ctx-size", type=int, default=None,
                   help="llama-server -c (default: slots x (prompt + output + 64), rounded up)")
    g.add_argument("--llama-args", default="", help="extra llama-server flags, one quoted string")
    add_workload_args(p)
    p.set_defaults(random_input_len=512, random_output_len=128, random_range_ratio=1.0)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the pair this many times, the other server first each round and "
                        "new prompts each round; the table gives medians (default 1)")
    p.add_argument("--startup-timeout", type=float, default=1800.0,
                   help="seconds a started server may take to answer (radixray's first start "
                        "converts the GGUF)")
    p.add_argument("--output-dir", default="bench_compare",
                   help="where compare.md, compare.json, compare.png and the servers' logs go")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(func=run_compare)
    return p
