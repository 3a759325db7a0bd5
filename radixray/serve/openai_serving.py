"""OpenAI-compatible /v1/completions and /v1/models, and the response shapes (SSE, usage,
logprobs, finish reasons) that /v1/chat/completions (:mod:`chat_serving`) shares.

Non-streaming handlers return a dict; streaming handlers return an async
iterator of SSE lines (``data: {...}\\n\\n`` ... ``data: [DONE]\\n\\n``).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator

from radixray.engine.request_ids import choice_rids, new_rid
from radixray.serve.api_error import ApiError
from radixray.serve.closing_stream import response_stream
from radixray.serve.frontend import Choice, Frontend
from radixray.serve.protocol import CompletionRequest

COMPLETION_DEFAULT_MAX_TOKENS = 16


# Valid unescaped in JSON, but line breaks to clients that split lines like
# str.splitlines() (httpx's iter_lines among them): always sent as \u escapes.
_LINE_BREAKING = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj) -> str:
    """One server-sent event: ``data: <json>`` and a blank line; the JSON never spans lines."""
    return f"data: {json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKING)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def finish_reason(choice: Choice) -> str | None:
    """OpenAI finish_reason: stop | length | abort (engine aborts, e.g. out of memory). A
    choice the engine failed never gets here: it is answered as an error."""
    if choice.meta is None or choice.meta.finish_reason is None:
        return None
    return choice.meta.finish_reason.type


def matched_stop(choice: Choice):
    fr = choice.meta.finish_reason if choice.meta is not None else None
    return fr.matched if fr is not None and fr.type == "stop" else None


def usage(fe: Frontend, choices: list[Choice], prompts_per_choice: int = 1) -> dict:
    """Token usage; each distinct prompt counts once even when n > 1."""
    firsts = choices[::prompts_per_choice]
    prompt = sum(len(c.prompt_ids) for c in firsts)
    completion = sum(len(c.output_ids) for c in choices)
    out = {"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion}
    if fe.enable_cache_report:
        cached = sum(c.meta.cached_tokens if c.meta else 0 for c in firsts)
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def stream_error(choice: Choice) -> str:
    return sse(choice.api_error().body())


def _token_entry(fe: Frontend, token_id: int, logprob: float) -> dict:
    text = fe.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(fe: Frontend, ids, lps, tops) -> dict:
    content = []
    for i, (tid, lp) in enumerate(zip(ids, lps)):
        entry = _token_entry(fe, tid, lp)
        entry["top_logprobs"] = [_token_entry(fe, t, v) for t, v in tops[i]] if i < len(tops) else []
        content.append(entry)
    return {"content": content}


def completion_logprobs(fe: Frontend, ids, lps, tops, offset: int = 0) -> dict:
    """The legacy completions ``logprobs`` object of tokens ``ids``: ``text_offset`` counts
    the token texts' characters from ``offset``; a None top list (an echoed prompt's first
    token) stays null."""
    tokens = [fe.token_text(t) for t in ids]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    top = [None if tops[i] is None else {fe.token_text(t): v for t, v in tops[i]}
           for i in range(len(tops))] if tops else None
    return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top,
            "text_offset": offsets}


def _echo_logprobs(fe: Frontend, c: Choice) -> dict:
    """``echo`` with ``logprobs``: the prompt's tokens (the first with a null logprob and
    null top logprobs), then the completion's, ``text_offset`` running on."""
    lps = c.input_logprobs if c.input_logprobs is not None else [None] * len(c.prompt_ids)
    tops = c.input_top_logprobs
    if tops is not None or c.top_logprobs:
        tops = (tops or [None] * len(c.prompt_ids)) + list(c.top_logprobs)
    return completion_logprobs(fe, c.prompt_ids + c.output_ids, list(lps) + list(c.logprobs),
                               tops)


def _prompt_texts(fe: Frontend, prompt, prompts: list[list[int]]) -> list[str]:
    """The text ``echo`` returns for each prompt: the string as given, or the token ids
    decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [fe.tokenizer.decode(ids) for ids in prompts]


# ---- /v1/completions ----------------------------------------------------------------------
def completion_prompts(fe: Frontend, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        return [fe.encode(prompt)] if prompt else [[]]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        bad = next((t for t in prompt if not 0 <= t < fe.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"prompt contains token id {bad}, outside the vocabulary "
                           f"[0, {fe.vocab_size})", param="prompt")
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [fe.encode(p) if p else [] for p in prompt]
    return [completion_prompts(fe, p)[0] for p in prompt]


async def completion(fe: Frontend, req: CompletionRequest, session_id: str | None = None):
    """``echo``: each choice's text (and, with ``logprobs``, its logprobs) starts with its
    prompt; the prompt tokens' logprobs come from the engine (``logprob_start_len`` 0), the
    first one null. ``max_tokens`` 0 is taken with ``echo`` only (score a prompt, generate
    nothing); ``suffix`` is refused."""
    adapter = await fe.resolve_model(req.model)
    fe.limits.check_openai(req, "logprobs")
    if req.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if req.max_tokens == 0 and not req.echo:
        raise ApiError(400, "max_tokens must be at least 1; 0 is accepted only with echo=true "
                       "(the prompt's logprobs alone)", param="max_tokens")
    prompts = completion_prompts(fe, req.prompt)
    echoes = _prompt_texts(fe, req.prompt, prompts) if req.echo else None
    all_ids, params = [], []
    for ids in prompts:
        asked = COMPLETION_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        max_tokens = fe.check_prompt(ids, asked, "prompt")
        for i in range(req.n):
            sp = req.sampling_params(max_tokens, i)
            if req.logprobs is not None:
                sp["return_logprob"] = True
                sp["top_logprobs_num"] = req.logprobs
                if req.echo:
                    sp["logprob_start_len"] = 0
            all_ids.append(ids)
            params.append(sp)
    echo_of = (lambda c: echoes[c.index // req.n]) if echoes else (lambda c: "")
    text = req.prompt if isinstance(req.prompt, str) else None
    base = req.rid or new_rid()  # the ingress sets it (serve/request_id.py)
    choices, streams = await fe.start(all_ids, params, rids=choice_rids(base, len(all_ids)),
                                      route_text=text, session_id=session_id, lora_path=adapter)
    rid = f"cmpl-{base}"
    if req.stream:
        return response_stream(_completion_stream(fe, req, rid, choices, streams, echo_of), streams)
    await fe.complete(choices, streams)
    out = [{"index": c.index, "text": echo_of(c) + c.text, "finish_reason": finish_reason(c),
            "matched_stop": matched_stop(c), "logprobs": None if req.logprobs is None else
            _echo_logprobs(fe, c) if req.echo else
            completion_logprobs(fe, c.output_ids, c.logprobs, c.top_logprobs)} for c in choices]
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": fe.served_model_name, "choices": out, "usage": usage(fe, choices, req.n)}


async def _completion_stream(fe: Frontend, req: CompletionRequest, rid: str,
                             choices: list[Choice], streams, echo_of) -> AsyncIterator[str]:
    """With ``echo`` each choice's first chunk is its prompt (and the prompt's logprobs),
    sent once the prompt is prefilled; ``text_offset`` runs on from it."""
    base = {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": fe.served_model_name}
    offsets = {c.index: 0 for c in choices}
    echoed: set[int] = set()
    async with contextlib.aclosing(fe.interleave(choices, streams)) as updates:
        async for c, delta, update in updates:
            if c.error:
                yield stream_error(c)
                continue
            if req.echo and c.index not in echoed:
                echoed.add(c.index)
                lp = None
                if req.logprobs is not None:
                    lp = completion_logprobs(fe, c.prompt_ids, c.input_logprobs or
                                             [None] * len(c.prompt_ids), c.input_top_logprobs)
                    if lp["tokens"]:
                        offsets[c.index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                yield sse({**base, "choices": [{"index": c.index, "text": echo_of(c),
                                                "logprobs": lp, "finish_reason": None}]})
            lp = None
            if req.logprobs is not None and update.ids:
                lp = completion_logprobs(fe, update.ids, update.logprobs or [],
                                         update.top_logprobs or [], offsets[c.index])
            offsets[c.index] += len(delta)
            if delta or lp or c.meta is not None:
                body = {**base, "choices": [{"index": c.index, "text": delta, "logprobs": lp,
                                             "finish_reason": finish_reason(c)}]}
                if req.continuous_usage:
                    body["usage"] = usage(fe, choices, req.n)
                yield sse(body)
    if req.include_usage:
        yield sse({**base, "choices": [], "usage": usage(fe, choices, req.n)})
    yield SSE_DONE


async def models_list(fe: Frontend) -> dict:
    """The served model, then each LoRA adapter the fleet serves (``parent``: the model;
    a request names one as ``model`` alone or as ``<model>:<adapter>``)."""
    base = {"id": fe.served_model_name, "object": "model", "created": 0, "owned_by": "radixray",
            "root": fe.model_path, "parent": None, "max_model_len": fe.context_len}
    adapters = [{**base, "id": name, "root": path, "parent": fe.served_model_name}
                for name, path in sorted((await fe.refresh_adapters()).items())]
    return {"object": "list", "data": [base, *adapters]}
