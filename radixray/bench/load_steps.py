"""Step-load traces for ``radixray bench serve --load-steps``: phases of a Poisson rate.

``--load-steps 20s@0.2,60s@1.5,60s@0.2`` is a quiet phase, a burst and a quiet phase: for
each phase, its duration and its request rate (requests per second; 0: none). Arrivals
are a Poisson process within each phase, seeded per phase, so a phase's arrivals do not
change when another phase does. The load is open loop: each request is sent at its
arrival time whatever is in flight (random dataset, one turn per request).

A request belongs to the phase it was sent in. Per phase the result has the usual
summary of those requests (:func:`serve_metrics.summarize` over the phase's length, so
its output tok/s is the output of the requests sent in the phase per second of the
phase), the 503s (a full queue's refusals) apart from other failures, and, on a radixray
server, the fleet's worker-seconds and most workers in the phase (sampled from /metrics,
:mod:`radixray.bench.fleet_sampler`). The run lasts at least the trace's length, so the
samples cover a scale-down late in the last phase.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import time
from collections import Counter
from dataclasses import dataclass

from radixray.bench import datasets, fleet_sampler
from radixray.bench.serve_metrics import RequestRecord, summarize
from radixray.bench.stream_client import RunConfig, run_benchmark

_STEP = re.compile(r"^\s*(\d+(?:\.\d*)?)s@(\d+(?:\.\d*)?)\s*$")
REJECTED = "HTTP 503"  # how stream_client records a 503 (a worker's full queue)


@dataclass(frozen=True)
class LoadStep:
    """One phase: ``duration_s`` seconds of Poisson arrivals at ``rate`` requests/s."""

    duration_s: float
    rate: float

    def __str__(self) -> str:
        return f"{self.duration_s:g}s@{self.rate:g}"


def parse_load_steps(spec: str) -> list[LoadStep]:
    """``"30s@0.2,60s@4"`` -> phases. Raises ValueError naming ``--load-steps`` and the bad
    part: each part is ``<seconds>s@<rate>``, seconds > 0, rate >= 0, one rate > 0."""
    steps = []
    for part in spec.split(","):
        m = _STEP.match(part)
        if m is None:
            raise ValueError(f"--load-steps: {part.strip()!r} is not <seconds>s@<requests per "
                             f"second> (e.g. 30s@0.2,60s@4,60s@0.2)")
        step = LoadStep(float(m.group(1)), float(m.group(2)))
        if step.duration_s <= 0:
            raise ValueError(f"--load-steps: {part.strip()!r} lasts no time; durations must be > 0")
        steps.append(step)
    if not any(s.rate > 0 for s in steps):
        raise ValueError(f"--load-steps: {spec!r} sends no request; give one phase a rate > 0")
    return steps


def format_load_steps(steps: list[LoadStep]) -> str:
    return ",".join(map(str, steps))


def phase_bounds(steps: list[LoadStep]) -> list[tuple[float, float]]:
    """(start, end) of each phase in seconds from the trace's start."""
    out, t = [], 0.0
    for step in steps:
        out.append((t, t + step.duration_s))
        t += step.duration_s
    return out


def step_arrivals(steps: list[LoadStep], seed: int) -> list[tuple[float, int]]:
    """(arrival offset in s, phase index) of every request, in time order. Within phase k
    the gaps are exponential with mean 1 / rate, drawn from a generator seeded by
    (``seed``, k); the first gap is measured from the phase's start (the Poisson process
    is memoryless, so a phase boundary does not bend it)."""
    out = []
    for k, ((start, end), step) in enumerate(zip(phase_bounds(steps), steps)):
        if step.rate <= 0:
            continue
        rng = random.Random(f"load-steps:{seed}:{k}")
        t = start + rng.expovariate(step.rate)
        while t < end:
            out.append((t, k))
            t += rng.expovariate(step.rate)
    return out


def phase_summaries(records: list[RequestRecord], phase_of: dict[int, int],
                    steps: list[LoadStep], slo_ttft_ms: float | None = None,
                    slo_tpot_ms: float | None = None) -> list[dict]:
    """One summary per phase of the records whose request (``record.index``) ``phase_of``
    places in it: :func:`summarize` over the phase's length, plus ``phase``, ``rate``,
    ``start_s``, ``rejected_503``, ``other_failures`` and ``failure_errors`` (each distinct
    error of the other failures, its first 200 characters, with its count)."""
    out = []
    for k, ((start, end), step) in enumerate(zip(phase_bounds(steps), steps)):
        mine = [r for r in records if phase_of.get(r.index) == k]
        s = summarize(mine, step.duration_s, label=f"phase {k}", request_rate=step.rate,
                      slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)
        rejected = sum(1 for r in mine if not r.success and (r.error or "").startswith(REJECTED))
        errors = Counter((r.error or "no error recorded")[:200] for r in mine
                         if not r.success and not (r.error or "").startswith(REJECTED))
        s.update(phase=k, step=str(step), rate=step.rate, start_s=start, end_s=end,
                 rejected_503=rejected, other_failures=s["failed"] - rejected,
                 failure_errors=dict(errors.most_common()))
        out.append(s)
    return out


def fleet_fields(samples: list[fleet_sampler.FleetSample], phases: list[dict],
                 end: float, failures: int) -> dict:
    """The fleet's worker accounting over ``[0, end]`` (samples on the run's clock) and per
    phase (written into ``phases``); empty figures when no sample had autoscaling series."""
    ws = fleet_sampler.worker_seconds(samples, 0.0, end)
    for phase in phases:
        per = fleet_sampler.worker_seconds(samples, phase["start_s"], phase["end_s"])
        phase["worker_seconds"] = sum(per.values()) if per else None
        phase["max_workers"] = fleet_sampler.max_workers(samples, phase["start_s"],
                                                         phase["end_s"]).get("total")
        phase["decisions"] = fleet_sampler.decisions_between(samples, phase["start_s"],
                                                             phase["end_s"])
    peak = fleet_sampler.max_workers(samples, 0.0, end)
    return {"worker_seconds": sum(ws.values()) if ws else None,
            "worker_seconds_held": fleet_sampler.held_worker_seconds(samples, 0.0, end),
            "worker_seconds_by_role": ws, "max_workers": peak.get("total"),
            "max_workers_by_role": {k: v for k, v in peak.items() if k != "total"},
            "decisions": fleet_sampler.decisions_between(samples, 0.0, end),
            "fleet_timeline": [s.to_json() for s in samples], "metrics_scrape_failures": failures}


def request_points(records: list[RequestRecord], offset_of: dict[int, float]) -> list[dict]:
    """Per request, for plots: arrival ``t`` (s), ``ttft_s`` (None unless it succeeded) and
    ``outcome`` (``ok``, ``503`` or ``failed``)."""
    def outcome(r: RequestRecord) -> str:
        if r.success:
            return "ok"
        return "503" if (r.error or "").startswith(REJECTED) else "failed"
    return [{"t": offset_of[r.index], "ttft_s": r.ttft if r.success else None,
             "outcome": outcome(r)} for r in records]


def format_phases(summary: dict) -> str:
    """One line per phase: rate, sent, ok, 503s, other failures, p50/p99 TTFT, output
    tok/s, worker-seconds and most workers (n/a on servers without the series)."""
    def fmt(v, spec=".0f"):
        return "n/a" if v is None else format(v, spec)
    head = (f"{'phase':>14} {'sent':>5} {'ok':>5} {'503':>5} {'fail':>5} {'p50 TTFT ms':>12} "
            f"{'p99 TTFT ms':>12} {'out tok/s':>10} {'worker-s':>9} {'max wkr':>8}")
    lines = [head]
    for p in summary["phases"]:
        lines.append(f"{p['step']:>14} {p['num_requests']:>5} {p['completed']:>5} "
                     f"{p['rejected_503']:>5} {p['other_failures']:>5} "
                     f"{fmt(p['median_ttft_ms']):>12} {fmt(p['p99_ttft_ms']):>12} "
                     f"{p['output_throughput']:>10.1f} {fmt(p.get('worker_seconds')):>9} "
                     f"{fmt(p.get('max_workers'), 'd'):>8}")
    lines.append(f"whole trace: {summary['trace_s']:.1f} s, worker-seconds "
                 f"{fmt(summary['worker_seconds'])}, most workers "
                 f"{fmt(summary['max_workers'], 'd')}, decisions {summary['decisions'] or '-'}")
    for p in summary["phases"]:
        for error, count in p.get("failure_errors", {}).items():
            lines.append(f"{p['step']}: {count} failed with: {error}")
    return "\n".join(lines)


def check_trace_args(args: argparse.Namespace) -> None:
    """ValueError naming the flags when ``--load-steps`` meets flags it does not run with."""
    clash = [flag for flag, given in (
        ("--sweep", args.sweep), ("--max-concurrency", getattr(args, "max_concurrency", None)),
        ("--router-policy", getattr(args, "router_policy", None)),
        ("--request-rate", math.isfinite(getattr(args, "request_rate", math.inf)))) if given]
    if clash:
        raise ValueError(f"--load-steps sets the arrivals itself; leave out {', '.join(clash)}")
    if args.dataset != "random":
        raise ValueError(f"--load-steps runs the random dataset, not --dataset {args.dataset}")


def run_steps(args: argparse.Namespace, label: str, url: str, model: str, tokenizer, *,
              jsonl=None, sample_interval_s: float = 1.0) -> dict:
    """Run ``args.load_steps`` against ``url`` with /metrics sampled every
    ``sample_interval_s``; return the whole run's summary with ``phases``, the fleet's
    accounting (:func:`fleet_fields`) and ``requests`` (:func:`request_points`), after
    printing the phase table. ``trace_s``: the trace's length, or the time to the last
    reply when later. Goodput counts ``--slo-ttft-ms`` / ``--slo-tpot-ms``."""
    check_trace_args(args)
    steps = args.load_steps
    slo_ttft_ms, slo_tpot_ms = args.slo_ttft_ms, args.slo_tpot_ms
    arrivals = step_arrivals(steps, args.seed)
    built = datasets.build_random(tokenizer, len(arrivals) + args.warmup, args.random_input_len,
                                  args.random_output_len, args.random_range_ratio, args.seed)
    warm, items = built[:args.warmup], built[args.warmup:]
    phase_of = {it.index: k for it, (_, k) in zip(items, arrivals)}
    offset_of = {it.index: t for it, (t, _) in zip(items, arrivals)}
    cfg = RunConfig(base_url=url, model=model, api=args.api, label=label, seed=args.seed,
                    warmup=args.warmup, ignore_eos=args.ignore_eos, temperature=args.temperature,
                    request_timeout=args.request_timeout, progress=not args.disable_tqdm)
    length = phase_bounds(steps)[-1][1]
    started: list[float] = []
    sampler = fleet_sampler.FleetSampler(url, sample_interval_s).start()
    try:
        records, duration = asyncio.run(run_benchmark(
            cfg, items, lambda text: datasets.count_tokens(tokenizer, text), warm,
            offsets=[t for t, _ in arrivals], on_start=started.append))
        time.sleep(max(0.0, started[0] + length - time.perf_counter()))
    finally:
        samples = sampler.stop()
    samples = fleet_sampler.shift(samples, started[0]) if started else []
    summary = summarize(records, duration, label=label, request_rate=format_load_steps(steps),
                        slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)
    summary["load_steps"] = format_load_steps(steps)
    summary["phases"] = phase_summaries(records, phase_of, steps, slo_ttft_ms, slo_tpot_ms)
    summary["trace_s"] = max(duration, length)
    summary.update(fleet_fields(samples, summary["phases"], summary["trace_s"], sampler.failures))
    summary["requests"] = request_points(records, offset_of)
    print(format_phases(summary), flush=True)
    if jsonl:
        jsonl.writelines(json.dumps(r.to_json()) + "\n" for r in records)
        jsonl.flush()
    return summary


def steps_arg(value: str) -> list[LoadStep]:
    try:
        return parse_load_steps(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_load_steps_arg(p: argparse.ArgumentParser, default: str | None = None,
                       help: str = "a step-load trace instead of --request-rate") -> None:
    """The ``--load-steps`` flag (parsed into :class:`LoadStep` phases); ``default`` is a
    spec string."""
    p.add_argument("--load-steps", type=steps_arg, metavar="Ds@R,...",
                   default=None if default is None else parse_load_steps(default),
                   help=f"{help}: phases of D seconds at R requests/s (Poisson, open loop), "
                        f"e.g. 30s@0.2,60s@4,60s@0.2; results per phase, with the fleet's "
                        f"worker-seconds from /metrics" + (f" (default {default})" if default
                                                           else ""))
