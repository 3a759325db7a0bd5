"""OpenAI-compatible /v1/chat/completions on top of a Frontend (shapes shared with
/v1/completions live in :mod:`radixray.serve.openai_serving`).

Tools and reasoning: :mod:`chat_parsers` plans a request (the template's tools, the
grammar of a forced or triggered call, the parsers), :mod:`chat_template` renders it, and
:mod:`chat_output` splits each choice's text into reasoning, content and tool calls.

The non-streaming handler returns a dict; the streaming one an async iterator of SSE lines.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from radixray.engine.request_ids import choice_rids, new_rid
from radixray.serve.chat_output import ChoiceOutput, chat_finish_reason
from radixray.serve.chat_parsers import ChatPlan, plan
from radixray.serve.chat_template import render
from radixray.serve.closing_stream import response_stream
from radixray.serve.frontend import Choice, Frontend
from radixray.serve.openai_serving import (
    SSE_DONE,
    chat_logprobs,
    finish_reason,
    matched_stop,
    sse,
    stream_error,
    usage,
)
from radixray.serve.protocol import ChatCompletionRequest


async def chat_completion(fe: Frontend, req: ChatCompletionRequest, session_id: str | None = None):
    adapter = await fe.resolve_model(req.model)
    fe.limits.check_openai(req, "top_logprobs")
    chat = plan(fe.chat, req)
    text = render(fe.tokenizer, chat.messages, chat.template_tools, req.chat_template_kwargs)
    ids = fe.tokenizer.encode(text, add_special_tokens=False)
    max_tokens = fe.check_prompt(ids, req.max_completion_tokens or req.max_tokens, "messages")
    params = []
    for i in range(req.n):
        sp = req.sampling_params(max_tokens, i)
        if req.logprobs:
            sp["return_logprob"] = True
            sp["top_logprobs_num"] = req.top_logprobs or 0
        params.append(chat.choice_params(fe.chat, sp))
    base = req.rid or new_rid()  # the ingress sets it (serve/request_id.py)
    choices, streams = await fe.start([ids] * req.n, params, rids=choice_rids(base, req.n),
                                      route_text=text, session_id=session_id, lora_path=adapter)
    rid = f"chatcmpl-{base}"
    if req.stream:
        return response_stream(_chat_stream(fe, req, chat, rid, choices, streams), streams)
    await fe.complete(choices, streams)
    out = []
    for c in choices:
        split = ChoiceOutput(chat)
        item = {"index": c.index, "message": split.message(c.text),
                "logprobs": chat_logprobs(fe, c.output_ids, c.logprobs, c.top_logprobs)
                if req.logprobs else None,
                "finish_reason": chat_finish_reason(finish_reason(c), split.has_calls),
                "matched_stop": matched_stop(c)}
        out.append(item)
    return {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": fe.served_model_name, "choices": out, "usage": usage(fe, choices, req.n)}


async def _chat_stream(fe: Frontend, req: ChatCompletionRequest, chat: ChatPlan, rid: str,
                       choices: list[Choice], streams) -> AsyncIterator[str]:
    created = int(time.time())
    base = {"id": rid, "object": "chat.completion.chunk", "created": created,
            "model": fe.served_model_name}
    splits = {c.index: ChoiceOutput(chat) for c in choices}

    def chunk(index: int, delta: dict, reason=None, logprobs=None) -> str:
        body = {**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": reason}]}
        if req.continuous_usage:
            body["usage"] = usage(fe, choices, req.n)
        return sse(body)
    for c in choices:
        yield chunk(c.index, {"role": "assistant", "content": ""})
    async with contextlib.aclosing(fe.interleave(choices, streams)) as updates:
        async for c, text, update in updates:
            if c.error:
                yield stream_error(c)
                continue
            split = splits[c.index]
            lp = None
            if req.logprobs and update.ids:
                lp = chat_logprobs(fe, update.ids, update.logprobs or [], update.top_logprobs or [])
            delta = split.feed(text, at_end=c.meta is not None)
            if delta or lp:
                yield chunk(c.index, split.delta_dict(delta), logprobs=lp)
            if c.meta is not None:
                yield chunk(c.index, {}, reason=chat_finish_reason(finish_reason(c), split.has_calls))
    if req.include_usage:
        yield sse({**base, "choices": [], "usage": usage(fe, choices, req.n)})
    yield SSE_DONE
