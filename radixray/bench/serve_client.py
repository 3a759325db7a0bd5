"""``radixray bench serve``: a streaming load generator for any OpenAI-compatible server.

Sends a workload from :mod:`radixray.bench.datasets` to ``/v1/completions`` or
``/v1/chat/completions`` with ``stream=True`` and reads the SSE stream with
httpx. Per request it records TTFT, every inter-token gap, E2E latency and the
token counts the server reports in its final usage chunk;
:mod:`radixray.bench.serve_metrics` aggregates them. Several servers
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
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from radixray.bench import datasets, server_side
from radixray.bench.serve_metrics import (
    RequestRecord,
    format_summary,
    format_sweep_table,
    summarize,
)
from radixray.cluster.routing import POLICIES

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


class ServerUnreachable(RuntimeError):
    """The server at a base URL did not answer, or listed no model when one was needed."""


def get_model_id(base_url: str, model: str | None = None, timeout: float = 10.0) -> str:
    """Check that ``base_url`` answers ``GET /v1/models``; return ``model`` or else the first listed id.

    Raises :class:`ServerUnreachable` (its message names the URL) when the
    server does not answer, or when ``model`` is None and none is listed.
    """
    import httpx
    url = base_url.rstrip("/") + "/v1/models"
    try:
        resp = httpx.get(url, timeout=timeout)
    except httpx.HTTPError as e:
        raise ServerUnreachable(f"cannot reach the server at {url}: {type(e).__name__}: {e}") from e
    if model:
        return model
    try:
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ServerUnreachable(f"{url} listed no model ({e}); pass --model") from e


@dataclass
class StreamOutcome:
    """What one streamed request returned. Times are seconds from just before the send."""

    success: bool = False
    text: str = ""
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None
    usage: dict | None = None
    error: str | None = None

    def _usage(self, key: str) -> int | None:
        return (self.usage or {}).get(key)

    @property
    def prompt_tokens(self) -> int | None:
        return self._usage("prompt_tokens")

    @property
    def completion_tokens(self) -> int | None:
        return self._usage("completion_tokens")

    @property
    def cached_tokens(self) -> int | None:
        """``usage.prompt_tokens_details.cached_tokens``; None when the server did not send it."""
        return (self._usage("prompt_tokens_details") or {}).get("cached_tokens")


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if "text" in choices[0]:
        return choices[0]["text"] or ""
    return (choices[0].get("delta") or {}).get("content") or ""


async def stream_request(client, url: str, body: dict, headers: dict | None = None) -> StreamOutcome:
    """POST ``body`` to ``url`` with ``client`` (an ``httpx.AsyncClient``) and read the SSE stream to its end.

    A chunk carries text when its first choice has a non-empty ``text``
    (completions) or ``delta.content`` (chat). TTFT is the time to the first such
    chunk; ``itl`` holds one gap per later such chunk, however many tokens it
    holds. The last ``usage`` object seen is kept. Failure (``success`` False,
    ``error`` set) is a non-200 status, a chunk with an ``error`` key, any
    exception, or a stream that ends without text. Never raises, except on
    cancellation.
    """
    out = StreamOutcome()
    pieces: list[str] = []
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")
                out.error = f"HTTP {resp.status_code}: {detail[:500]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if chunk.get("error") is not None or chunk.get("object") == "error":
                    out.error = f"error event in stream: {json.dumps(chunk.get('error', chunk))[:500]}"
                    return out
                if chunk.get("usage"):
                    out.usage = chunk["usage"]
                text = _chunk_text(chunk)
                if text:
                    now = time.perf_counter()
                    if out.ttft is None:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    pieces.append(text)
        if out.ttft is None:
            out.error = "the stream ended without any text"
        else:
            out.success = True
    except Exception as e:  # network errors and bad JSON are results, not crashes
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.latency = time.perf_counter() - start
        out.text = "".join(pieces)
    return out


def request_body(api: str, model: str, prompt: str | list[dict], max_tokens: int,
                 temperature: float = 0.0, ignore_eos: bool = True) -> dict:
    """A streaming request body; ``prompt`` is a text (completions) or a message list (chat)."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    body["messages" if api == "chat" else "prompt"] = prompt
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def build_prompt(api: str, item: datasets.Conversation, turn: int,
                 replies: list[str]) -> str | list[dict]:
    """The prompt of ``item``'s turn ``turn``: system, earlier turns with their ``replies``, then the new turn.

    Chat: a message list. Completions: the same texts concatenated as they are.
    """
    history = [(t, r) for t, r in zip(item.turns[:turn], replies)]
    if api == "chat":
        msgs = [{"role": "system", "content": item.system}] if item.system else []
        for text, reply in history:
            msgs += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
        return msgs + [{"role": "user", "content": item.turns[turn]}]
    return (item.system or "") + "".join(t + r for t, r in history) + item.turns[turn]


def _prompt_text(prompt: str | list[dict]) -> str:
    return prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)


@dataclass
class RunConfig:
    """One benchmark run against one server at one concurrency limit."""

    base_url: str
    model: str
    api: str = "completions"
    label: str = ""
    max_concurrency: int | None = None
    request_rate: float = math.inf
    seed: int = 1
    warmup: int = 1
    ignore_eos: bool = True
    temperature: float = 0.0
    request_timeout: float = 3600.0
    progress: bool = True
    session_header: bool = True  # multi-turn: send X-Session-Id (the server may pin sessions)


def arrival_offsets(n: int, request_rate: float, seed: int) -> list[float]:
    """Start times (s) of ``n`` arrivals: all 0 when the rate is infinite, else a seeded Poisson process."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


async def run_benchmark(cfg: RunConfig, items: list[datasets.Conversation],
                        count_tokens: Callable[[str], int],
                        warmup_items: list[datasets.Conversation] | None = None,
                        ) -> tuple[list[RequestRecord], float]:
    """Send ``cfg.warmup`` excluded warm-up requests, then ``items``; return (records, duration in s).

    Warm-up requests are the first turns of ``warmup_items`` (default: the first
    items), sent one by one.
    Conversations start at :func:`arrival_offsets`; a conversation's turns go one
    after another, each carrying the replies so far; at most
    ``cfg.max_concurrency`` requests are in flight. Once a turn fails, the
    conversation's later turns are recorded as failed without being sent.
    ``count_tokens`` counts tokens the server did not report. Records come
    ordered by conversation, then turn; the duration runs from the first arrival
    to the last reply.
    """
    import httpx
    from tqdm import tqdm

    url = cfg.base_url.rstrip("/") + ENDPOINTS[cfg.api]
    timeout = httpx.Timeout(cfg.request_timeout, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        warm = warmup_items or items
        for i in range(cfg.warmup if warm else 0):
            item = warm[i % len(warm)]
            body = request_body(cfg.api, cfg.model, build_prompt(cfg.api, item, 0, []),
                                item.output_len, cfg.temperature, cfg.ignore_eos)
            out = await stream_request(client, url, body)
            if not out.success:
                print(f"warning: warm-up request {i} failed: {out.error}", file=sys.stderr)
        bar = tqdm(total=sum(len(it.turns) for it in items), desc=cfg.label or None,
                   disable=not cfg.progress)
        offsets = arrival_offsets(len(items), cfg.request_rate, cfg.seed)
        start = time.perf_counter()

        async def converse(item: datasets.Conversation, offset: float) -> list[RequestRecord]:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            headers = ({"X-Session-Id": item.session_id}
                       if item.session_id and cfg.session_header else None)
            records: list[RequestRecord] = []
            replies: list[str] = []
            for turn in range(len(item.turns)):
                rec = RequestRecord(index=item.index, label=cfg.label, concurrency=cfg.max_concurrency,
                                    session_id=item.session_id, turn=turn)
                records.append(rec)
                if len(replies) < turn:
                    rec.error = "not sent: an earlier turn of this conversation failed"
                    bar.update(1)
                    continue
                if turn and item.think_times:
                    await asyncio.sleep(item.think_times[turn - 1])
                prompt = build_prompt(cfg.api, item, turn, replies)
                body = request_body(cfg.api, cfg.model, prompt, item.output_len,
                                    cfg.temperature, cfg.ignore_eos)
                async with sem or contextlib.nullcontext():
                    out = await stream_request(client, url, body, headers)
                bar.update(1)
                _fill_record(rec, out, item.prompt_len if turn == 0 else None,
                             _prompt_text(prompt), count_tokens)
                if out.success:
                    replies.append(out.text)
            return records

        results = await asyncio.gather(*(converse(it, off) for it, off in zip(items, offsets)))
        duration = time.perf_counter() - start
        bar.close()
    return [r for rs in results for r in rs], duration


def _fill_record(rec: RequestRecord, out: StreamOutcome, known_prompt_len: int | None,
                 prompt_text: str, count_tokens: Callable[[str], int]) -> None:
    """Copy ``out`` into ``rec``; counts the server did not report come from the tokenizer."""
    rec.success, rec.error = out.success, out.error
    rec.ttft, rec.itl, rec.latency = out.ttft, out.itl, out.latency
    rec.cached_tokens = out.cached_tokens
    rec.prompt_tokens = out.prompt_tokens
    if rec.prompt_tokens is None:
        rec.prompt_tokens = known_prompt_len if known_prompt_len is not None else count_tokens(prompt_text)
    rec.output_tokens = out.completion_tokens
    if rec.output_tokens is None:
        rec.output_tokens = count_tokens(out.text) if out.text else 0


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


def json_safe(obj):
    """``obj`` with non-finite floats as strings ("inf"), so the JSON is standard."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_safe(v) for v in obj]
    return obj


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
    """
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
