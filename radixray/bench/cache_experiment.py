"""``radixray bench cache-experiment``: does the prefix cache survive a per-request id in the prompt?

The same long system prompt and short question go to ``/v1/chat/completions``
``--repeats`` times, one request at a time, in three forms:

- ``stable-system-prompt``: the same system prompt every time; after the first
  request a prefix cache can serve nearly the whole prompt.
- ``id-at-start``: ``"Request id <16 hex>. "`` + system prompt, a new id per
  request; the prompts differ from the first tokens on, so nothing is reused.
- ``id-at-end``: system prompt + ``" Request id <16 hex>."``; everything before
  the id is reusable.

Warm-up requests use an unrelated system prompt of the same length, so they
warm the server without warming any form. Prints one JSON line per form with
TTFT statistics and the server's reported prompt and cached tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys

from radixray.bench import datasets, json_safe
from radixray.bench.stream_client import (
    ENDPOINTS,
    ServerUnreachable,
    StreamOutcome,
    get_model_id,
    request_body,
    stream_request,
)

FORMS = ("stable-system-prompt", "id-at-start", "id-at-end")
DEFAULT_QUESTION = "In one sentence, what is the main topic of the text above?"


def form_system_prompt(form: str, system_prompt: str, rng: random.Random) -> str:
    """``system_prompt`` as sent in ``form``; id forms draw a fresh 16-hex id from ``rng``."""
    if form == "stable-system-prompt":
        return system_prompt
    request_id = f"{rng.getrandbits(64):016x}"
    if form == "id-at-start":
        return f"Request id {request_id}. {system_prompt}"
    if form == "id-at-end":
        return f"{system_prompt} Request id {request_id}."
    raise ValueError(f"unknown form {form!r}; expected one of {FORMS}")


def summarize_form(form: str, outcomes: list[StreamOutcome]) -> dict:
    """TTFT (ms) statistics and median reported token counts over the successful ``outcomes``.

    Token fields are None when the server did not report them.
    """
    ok = [o for o in outcomes if o.success]
    ttfts = [o.ttft * 1000.0 for o in ok]
    cached = [o.cached_tokens for o in ok if o.cached_tokens is not None]
    prompt = [o.prompt_tokens for o in ok if o.prompt_tokens is not None]
    return {"summary": form,
            "median_ttft_ms": statistics.median(ttfts) if ttfts else None,
            "min_ttft_ms": min(ttfts, default=None),
            "max_ttft_ms": max(ttfts, default=None),
            "median_cached_tokens": statistics.median_low(cached) if cached else None,
            "prompt_tokens": statistics.median_low(prompt) if prompt else None,
            "requests": len(outcomes),
            "failed": len(outcomes) - len(ok)}


async def run_cache_experiment(base_url: str, model: str, system_prompt: str, question: str, *,
                               warmup_system_prompt: str, repeats: int = 5, warmup: int = 2,
                               max_tokens: int = 8, seed: int = 1,
                               request_timeout: float = 600.0) -> list[dict]:
    """Send ``warmup`` warm-up requests, then ``repeats`` requests per form in :data:`FORMS` order.

    Requests go one at a time. Returns one :func:`summarize_form` dict per form;
    failed requests are counted there, never raised.
    """
    import httpx
    rng = random.Random(seed)
    url = base_url.rstrip("/") + ENDPOINTS["chat"]

    def body(system: str) -> dict:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return request_body("chat", model, messages, max_tokens)

    results = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=30.0)) as client:
        for _ in range(warmup):
            await stream_request(client, url, body(warmup_system_prompt))
        for form in FORMS:
            outcomes = [await stream_request(client, url, body(form_system_prompt(form, system_prompt, rng)))
                        for _ in range(repeats)]
            results.append(summarize_form(form, outcomes))
    return results


def run_cli(args: argparse.Namespace) -> int:
    """Run the experiment of ``args``; 0 when it ran, 1 when the server does not answer."""
    try:
        model = get_model_id(args.base_url, args.model)
    except ServerUnreachable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tokenizer = datasets.load_tokenizer(args.tokenizer)
    sampler = datasets.sampler_for(tokenizer)
    rng = random.Random(args.seed)
    system_prompt, _ = sampler.random_text(args.system_prompt_len, rng)
    warmup_prompt, _ = sampler.random_text(args.system_prompt_len, rng)
    results = asyncio.run(run_cache_experiment(
        args.base_url, model, system_prompt, args.question, warmup_system_prompt=warmup_prompt,
        repeats=args.repeats, warmup=args.warmup, max_tokens=args.max_tokens, seed=args.seed,
        request_timeout=args.request_timeout))
    for r in results:
        print(json.dumps(json_safe(r)))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(json_safe(results), f, indent=2)
    return 0


def add_parser(bench_subparsers) -> argparse.ArgumentParser:
    """Add the ``cache-experiment`` subcommand to ``bench_subparsers``; its ``func`` is :func:`run_cli`."""
    p = bench_subparsers.add_parser(
        "cache-experiment", help="prefix-cache reuse with a request id at the start/end of the system prompt",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model id to send (default: first id of GET /v1/models)")
    p.add_argument("--tokenizer", default="default",
                   help="'default' (radixray's default model) or a model/tokenizer folder")
    p.add_argument("--system-prompt-len", type=int, default=3000, help="system prompt tokens")
    p.add_argument("--question", default=DEFAULT_QUESTION)
    p.add_argument("--repeats", type=int, default=5, help="requests per form")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests, left out of the results")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=1, help="fixes the system prompt and the request ids")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--output-json", default=None, help="write the three summaries as a JSON list")
    p.add_argument("--log-level", default="warning")
    p.set_defaults(func=run_cli)
    return p
