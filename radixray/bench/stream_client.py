"""The streaming client of the serving benchmarks: one request's SSE stream, and a run of
conversations sent at their arrival times.

:func:`stream_request` POSTs one ``stream=True`` request to ``/v1/completions`` or
``/v1/chat/completions`` and records TTFT, every inter-token gap, E2E latency and the
token counts of the final usage chunk; :func:`run_benchmark` sends a workload of
:class:`radixray.bench.datasets.Conversation` at given arrival offsets and returns one
:class:`radixray.bench.serve_metrics.RequestRecord` per request. ``bench serve``
(serve_client.py), ``bench compare``, ``bench cache-experiment`` and the step-load traces
(load_steps.py) run through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from radixray.bench import datasets
from radixray.bench.serve_metrics import RequestRecord

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
    finish = None  # the last finish_reason seen (named when no text came)
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
                finish = (chunk.get("choices") or [{}])[0].get("finish_reason") or finish
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
            tokens = (out.usage or {}).get("completion_tokens", "no usage:")
            out.error = (f"the stream ended without any text ({tokens} completion tokens, "
                         f"finish_reason {finish})")
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
                        offsets: list[float] | None = None,
                        on_start: Callable[[float], None] | None = None,
                        ) -> tuple[list[RequestRecord], float]:
    """Send ``cfg.warmup`` excluded warm-up requests, then ``items``; return (records, duration in s).

    Warm-up requests are the first turns of ``warmup_items`` (default: the first
    items), sent one by one.
    Conversations start at ``offsets`` (seconds after the start; default
    :func:`arrival_offsets`), whatever is in flight; a conversation's turns go one
    after another, each carrying the replies so far; at most
    ``cfg.max_concurrency`` requests are in flight. Once a turn fails, the
    conversation's later turns are recorded as failed without being sent.
    ``count_tokens`` counts tokens the server did not report. Records come
    ordered by conversation, then turn; the duration runs from the first arrival
    to the last reply. ``on_start`` gets the ``time.perf_counter()`` of the start
    (after the warm-up).
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
        if offsets is None:
            offsets = arrival_offsets(len(items), cfg.request_rate, cfg.seed)
        start = time.perf_counter()
        if on_start is not None:
            on_start(start)

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
