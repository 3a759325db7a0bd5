"""Text work of one ingress replica: tokenize, apply chat templates, check limits,
start requests on a worker, and turn token updates back into text.

Both HTTP APIs (``openai_serving``, ``native_serving``) sit on :class:`Frontend`;
the worker only ever sees token ids.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from radixray.cluster.messages import SubmitRequest, WorkerInfo
from radixray.cluster.routing import adapter_route_text
from radixray.engine.detokenizer import IncrementalDetokenizer
from radixray.engine.messages import MetaInfo, RequestUpdate
from radixray.engine.sampling import SamplingParams
from radixray.serve.api_error import ApiError, api_error_from
from radixray.serve.chat_parsers import ChatFeatures
from radixray.serve.dispatch import Dispatcher, close_all, ids_route_text
from radixray.serve.limits import RequestLimits


@dataclass
class Choice:
    """One running generation as text: feed it worker updates, read deltas."""

    index: int
    rid: str
    prompt_ids: list[int]
    detok: IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list] = field(default_factory=list)
    # prompt logprobs (return_logprob): one per prompt position from logprob_start_len, the
    # first None; set by the first update after the prompt's prefill
    input_logprobs: list | None = None
    input_top_logprobs: list | None = None
    text: str = ""
    meta: MetaInfo | None = None
    error: str | None = None
    error_status: int = 500

    def add(self, update: RequestUpdate) -> str:
        """Apply one update; return the new releasable text."""
        if update.error is not None:
            self.error = update.error
            self.error_status = update.status or 500
            return ""
        ids = update.ids
        self.output_ids.extend(ids)
        self.logprobs.extend(update.logprobs or ())
        self.top_logprobs.extend(update.top_logprobs or ())
        if update.input_logprobs is not None:
            self.input_logprobs = update.input_logprobs
            self.input_top_logprobs = update.input_top_logprobs
        delta = self.detok.add_tokens(ids)
        if update.meta is not None:
            self.meta = update.meta
            if not self.detok.stopped:
                delta += self.detok.finish()
        self.text += delta
        return delta

    @property
    def finished(self) -> bool:
        return self.meta is not None or self.error is not None

    def api_error(self) -> ApiError:
        """The error of a failed choice: a 503 when its worker or engine went down (retry
        later), a 500 when its batch failed, a 400 when its input was refused once running
        (a grammar that did not compile)."""
        kind = {503: "service_unavailable", 400: "invalid_request_error"}.get(
            self.error_status, "server_error")
        return ApiError(self.error_status, self.error, type=kind)


class Frontend:
    """Everything an HTTP handler needs from this ingress replica."""

    def __init__(self, tokenizer, info: WorkerInfo, served_model_name: str,
                 dispatcher: Dispatcher, enable_cache_report: bool = True, limits=None,
                 chat: ChatFeatures | None = None, adapter_source=None):
        """``limits``: a :class:`radixray.serve.limits.RequestLimits` (default: its defaults);
        ``chat``: the model's tool-call and reasoning handling (default: tools refused, no
        reasoning parser); ``adapter_source``: an async call answering the fleet's LoRA
        adapters (name -> path; None: no adapters)."""
        self.limits = limits or RequestLimits()
        self.chat = chat or ChatFeatures()
        self.tokenizer = tokenizer
        self.context_len = info.context_len
        self.vocab_size = info.vocab_size
        self.model_path = info.model
        self.served_model_name = served_model_name
        self.dispatcher = dispatcher
        self.enable_cache_report = enable_cache_report
        # the fleet's LoRA adapters as last asked (a name not in it asks again)
        self.adapters: dict[str, str] = {}
        self._adapter_source = adapter_source

    # ---- validation ------------------------------------------------------------------
    async def refresh_adapters(self) -> dict[str, str]:
        """Ask the fleet which LoRA adapters it serves now."""
        if self._adapter_source is not None:
            self.adapters = dict(await self._adapter_source())
        return self.adapters

    async def check_adapter(self, name: str, param: str, code: str | None = None) -> str:
        """``name`` if the fleet serves that adapter; else a 400 naming it."""
        if name not in self.adapters and name not in await self.refresh_adapters():
            raise ApiError(400, f"unknown LoRA adapter {name!r}; this server serves "
                           f"{sorted(self.adapters) or 'none'} (see GET /v1/models)",
                           param=param, code=code)
        return name

    async def resolve_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names, or None for the base model: the
        served name or model path (or no model) is the base; ``<base>:<adapter>`` or a bare
        adapter name an adapter. A 400 naming an unknown model or adapter."""
        if name is None or name in (self.served_model_name, self.model_path):
            return None
        for base in (self.served_model_name, self.model_path):
            if base and name.startswith(base + ":"):
                return await self.check_adapter(name[len(base) + 1:], "model", "model_not_found")
        if name in self.adapters or name in await self.refresh_adapters():
            return name
        raise ApiError(400, f"The model {name!r} does not exist; this server serves "
                       f"{self.served_model_name!r} and the LoRA adapters "
                       f"{sorted(self.adapters)} (see GET /v1/models)", param="model",
                       code="model_not_found")

    def check_prompt(self, ids: list[int], max_tokens: int | None, param: str) -> int:
        """Check the prompt fits; return max_tokens (default: the rest of the context)."""
        n, ctx = len(ids), self.context_len
        if n == 0:
            raise ApiError(400, f"{param} is empty: at least 1 token is required", param=param)
        if n >= ctx:
            raise ApiError(400, f"This model's maximum context length is {ctx} tokens; the "
                           f"{param} has {n} tokens. Shorten it.", param=param,
                           code="context_length_exceeded")
        if max_tokens is None:
            return ctx - n
        if n + max_tokens > ctx:
            raise ApiError(400, f"This model's maximum context length is {ctx} tokens; the "
                           f"{param} has {n} tokens and max_tokens asks for {max_tokens} more. "
                           f"Lower max_tokens to at most {ctx - n}.", param="max_tokens",
                           code="context_length_exceeded")
        return max_tokens

    # ---- text work -------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # ---- running -----------------------------------------------------------------------
    async def start(self, prompts: list[list[int]], params: list[dict], priority=None,
                    rids: list[str] | None = None, route_text: str | None = None,
                    session_id: str | None = None, lora_path: str | list | None = None
                    ) -> tuple[list[Choice], list[AsyncIterator]]:
        """Submit one request per (prompt, params) to one worker; raise ApiError if no
        worker takes them. ``route_text`` (default: the first prompt's ids as characters)
        is what the router matches; ``session_id`` pins a conversation to a worker;
        ``lora_path``: the LoRA adapter (checked) of every prompt, or one per prompt."""
        rids = rids or [uuid.uuid4().hex for _ in prompts]
        loras = lora_path if isinstance(lora_path, list) else [lora_path] * len(prompts)
        try:
            requests = [SubmitRequest(rid, ids, SamplingParams.from_dict(sp), priority,
                                      lora_path=lora)
                        for rid, ids, sp, lora in zip(rids, prompts, params, loras)]
        except (TypeError, ValueError) as exc:  # unknown or mistyped sampling fields
            raise ApiError(400, str(exc), param="sampling_params") from None
        if route_text is None:
            route_text = ids_route_text(prompts[0])
        route_text = adapter_route_text(route_text, loras[0])
        try:
            streams = await self.dispatcher.run(requests, route_text, session_id)
        except Exception as exc:
            raise api_error_from(exc) from None
        choices = [Choice(i, rid, ids, IncrementalDetokenizer(
            self.tokenizer, ids, skip_special_tokens=sp.get("skip_special_tokens", True),
            stop=sp.get("stop") or ())) for i, (rid, ids, sp) in enumerate(zip(rids, prompts, params))]
        return choices, streams

    async def run_to_end(self, choices: list[Choice], streams: list[AsyncIterator]) -> None:
        """Drive every choice to its end (non-streaming requests)."""
        async def drain(choice: Choice, stream: AsyncIterator) -> None:
            async for update in stream:
                choice.add(update)
        try:
            await asyncio.gather(*(drain(c, s) for c, s in zip(choices, streams)))
        finally:
            await close_all(streams)

    async def complete(self, choices: list[Choice], streams: list[AsyncIterator]) -> None:
        """Run every choice to its end; raise a 500 ApiError if the worker failed one."""
        await self.run_to_end(choices, streams)
        failed = next((c for c in choices if c.error), None)
        if failed:
            raise failed.api_error()

    async def interleave(self, choices: list[Choice], streams: list[AsyncIterator]):
        """Yield (choice, delta text, update) as updates arrive from any choice."""
        if len(streams) == 1:
            try:
                async for update in streams[0]:
                    yield choices[0], choices[0].add(update), update
            finally:
                await close_all(streams)
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            async for update in streams[i]:
                await queue.put((i, update))
            await queue.put((i, None))
        tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
        try:
            remaining = len(streams)
            while remaining:
                i, update = await queue.get()
                if update is None:
                    remaining -= 1
                    continue
                yield choices[i], choices[i].add(update), update
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # their streams close
            await close_all(streams)
