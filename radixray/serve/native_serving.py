"""Native POST /generate: text or input_ids in, text + output_ids + meta_info out.

Streaming sends SSE events whose ``text`` and ``output_ids`` hold everything
generated so far (not deltas), ending with ``data: [DONE]``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from radixray.engine.inputs import to_sampling_params
from radixray.engine.request_ids import new_rid
from radixray.serve.api_error import ApiError
from radixray.serve.closing_stream import response_stream
from radixray.serve.frontend import Choice, Frontend
from radixray.serve.openai_serving import SSE_DONE, sse
from radixray.serve.protocol import GenerateRequest
from radixray.serve.request_id import generation_rids


def _prompts(fe: Frontend, req: GenerateRequest) -> tuple[list[list[int]], bool]:
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "give exactly one of text or input_ids", param="text")
    if req.text is not None:
        texts = [req.text] if isinstance(req.text, str) else req.text
        if not texts:
            raise ApiError(400, "text must not be an empty list", param="text")
        return [fe.encode(t) if t else [] for t in texts], not isinstance(req.text, str)
    ids = req.input_ids
    if ids and isinstance(ids[0], list):
        return [list(x) for x in ids], True
    return [list(ids)], False


def _params(req: GenerateRequest, n: int) -> list[dict]:
    raw = req.sampling_params or {}
    try:
        sp = to_sampling_params(raw)  # unknown keys and bad values fail here, naming the field
        sp.validate()
    except ValueError as exc:
        raise ApiError(400, str(exc), param="sampling_params") from None
    params = dict(raw)
    if req.return_routed_experts:
        params["return_routed_experts"] = True
    if req.return_logprob:
        params["return_logprob"] = True
        params["top_logprobs_num"] = req.top_logprobs_num
        if req.logprob_start_len != -1:
            params["logprob_start_len"] = req.logprob_start_len
    return [dict(params) for _ in range(n)]


def _check_logprob_start(params: list[dict], prompts: list[list[int]]) -> None:
    """With return_logprob, ``logprob_start_len`` must name a position of every prompt."""
    for ids, sp in zip(prompts, params):
        start = sp.get("logprob_start_len", -1)
        if sp.get("return_logprob") and start >= len(ids):
            raise ApiError(400, f"logprob_start_len ({start}) must be less than the prompt's "
                           f"length ({len(ids)} tokens)", param="logprob_start_len")


def _meta(fe: Frontend, c: Choice, req: GenerateRequest) -> dict:
    """meta_info; with return_logprob, SGLang's logprob fields: ``[logprob, token id, text]``
    per token (text None unless return_text_in_logprobs), ``*_top_logprobs`` a list of those
    per token, and the input ones from logprob_start_len with the first entry's logprob (and
    top list) None."""
    meta = c.meta.to_json() if c.meta else {"id": c.rid, "finish_reason": None,
                                         "prompt_tokens": len(c.prompt_ids),
                                         "completion_tokens": len(c.output_ids)}
    if not req.return_logprob:
        return meta

    def entry(lp, t):
        return [lp, t, fe.token_text(t) if req.return_text_in_logprobs else None]

    def tops(per_token):
        return [None if top is None else [entry(v, t) for t, v in top] for top in per_token]
    meta["output_token_logprobs"] = [entry(lp, t) for lp, t in zip(c.logprobs, c.output_ids)]
    if c.top_logprobs:
        meta["output_top_logprobs"] = tops(c.top_logprobs)
    if c.input_logprobs is not None:
        ids = c.prompt_ids[len(c.prompt_ids) - len(c.input_logprobs):]
        meta["input_token_logprobs"] = [entry(lp, t) for lp, t in zip(c.input_logprobs, ids)]
        if c.input_top_logprobs is not None:
            meta["input_top_logprobs"] = tops(c.input_top_logprobs)
    return meta


def _result(fe: Frontend, c: Choice, req: GenerateRequest) -> dict:
    return {"text": c.text, "output_ids": list(c.output_ids), "meta_info": _meta(fe, c, req)}


async def _adapters(fe: Frontend, req: GenerateRequest, n: int) -> list[str | None] | None:
    """``lora_path``: one adapter for every prompt or one (or None) per prompt, each checked."""
    names = req.lora_path
    if names is None:
        return None
    if not isinstance(names, list):
        names = [names] * n
    elif len(names) != n:
        raise ApiError(400, f"lora_path has {len(names)} entries for {n} prompts",
                       param="lora_path")
    return [None if name is None else await fe.check_adapter(name, "lora_path")
            for name in names]


async def generate(fe: Frontend, req: GenerateRequest, session_id: str | None = None):
    fe.limits.check_native(req)
    prompts, is_batch = _prompts(fe, req)
    params = _params(req, len(prompts))
    for ids, sp in zip(prompts, params):
        param = "input_ids" if req.input_ids is not None else "text"
        sp["max_new_tokens"] = fe.check_prompt(ids, sp.get("max_new_tokens", 128), param)
    _check_logprob_start(params, prompts)
    if req.stream and is_batch:
        raise ApiError(400, "stream=true takes one prompt", param="stream")
    if isinstance(req.rid, list) and not is_batch:
        raise ApiError(400, "rid: a list of ids needs a batch of prompts", param="rid")
    rids = generation_rids(req.rid if req.rid is not None else new_rid(), len(prompts))
    text = req.text if isinstance(req.text, str) else None
    choices, streams = await fe.start(prompts, params, priority=req.priority, rids=rids,
                                      route_text=text, session_id=session_id,
                                      lora_path=await _adapters(fe, req, len(prompts)))
    if req.stream:
        return response_stream(_stream(fe, req, choices, streams), streams)
    await fe.complete(choices, streams)
    results = [_result(fe, c, req) for c in choices]
    return results if is_batch else results[0]


async def _stream(fe: Frontend, req: GenerateRequest, choices, streams) -> AsyncIterator[str]:
    async with contextlib.aclosing(fe.interleave(choices, streams)) as updates:
        async for c, delta, _ in updates:
            if c.error:
                yield sse(c.api_error().body())
                continue
            if delta or c.meta is not None:
                yield sse(_result(fe, c, req))
    yield SSE_DONE
