"""Naive baseline server: one Hugging Face ``model.generate`` per request, one request at a time.

The "before" picture radixray is measured against: transformers behind an
OpenAI-compatible FastAPI app, with no batching and no KV reuse across requests.
An ``asyncio.Lock`` serializes generation; ``generate`` runs in a worker thread,
so the event loop keeps accepting connections, which queue on the lock.

    radixray bench naive-server --model default --port 8001

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(``stream``, ``stream_options.include_usage``, ``stop``, ``seed`` and the ``ignore_eos``
extension are supported; ``n`` must be 1).
"""

# No `from __future__ import annotations`: FastAPI must see the real `Request` type of
# route parameters, and `Request` is imported inside create_app to keep this module light.
import asyncio
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16


def add_parser(bench_subparsers) -> None:
    """Register ``naive-server`` on the ``radixray bench`` subparsers; ``func(args)`` serves until Ctrl-C."""
    p = bench_subparsers.add_parser("naive-server", help="baseline: HF generate behind FastAPI, one request at a time")
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M GGUF), an HF folder or a .gguf")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=serve)


def serve(args) -> int:
    """Load the model and run the app with uvicorn until SIGINT/SIGTERM; returns the exit code."""
    import uvicorn
    server = NaiveServer.load(args.model, dtype=args.dtype, threads=args.threads, device=args.device)
    uvicorn.run(create_app(server), host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0


class BadRequest(ValueError):
    """A client error, answered with HTTP 400; ``param`` names the offending body field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class Job:
    """One request: prompt ids, sampling, stop strings and the flag that cancels generation."""

    prompt_ids: list[int]
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: whole vocabulary
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)
    streamer: Any = None  # a TextIteratorStreamer when the response streams

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6


@dataclass
class Completion:
    """What ``generate`` produced: every new token id (EOS included), the text cut at the first stop."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    cancelled: bool = False  # stopped early because the client went away


def _get(body: dict, name: str, types: tuple, default=None, ok=None, why: str = ""):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise BadRequest(f"{name}: expected {'/'.join(t.__name__ for t in types)}, "
                         f"got {type(value).__name__}", name)
    if ok is not None and not ok(value):
        raise BadRequest(f"{name}: {why} (got {value!r})", name)
    return value


def parse_job(body: Any, chat: bool, tokenizer, max_positions: int | None = None) -> Job:
    """Validate an OpenAI request body into a Job; raises BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages: a non-empty list of messages is required", "messages")
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # a malformed message or a template error
            raise BadRequest(f"messages: {e}", "messages") from e
        ids = tokenizer(text, add_special_tokens=False).input_ids
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = tokenizer(prompt).input_ids
        elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            if not all(0 <= t < len(tokenizer) for t in prompt):
                raise BadRequest(f"prompt: token ids must lie in [0, {len(tokenizer)})", "prompt")
            ids = list(prompt)
        else:
            raise BadRequest("prompt: a string or a non-empty list of token ids is required", "prompt")
    if not ids:
        raise BadRequest("the prompt has no tokens", "messages" if chat else "prompt")
    if _get(body, "n", (int,), 1) != 1:
        raise BadRequest("n: only n=1 is supported", "n")
    positive = dict(ok=lambda v: v >= 1, why="must be at least 1")
    max_tokens = _get(body, "max_tokens", (int,), DEFAULT_MAX_TOKENS, **positive)
    if chat:
        max_tokens = _get(body, "max_completion_tokens", (int,), max_tokens, **positive)
    if max_positions and len(ids) + max_tokens > max_positions:
        raise BadRequest(f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) "
                         f"exceeds the model's {max_positions} positions", "max_tokens")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise BadRequest("stop: expected a string or a list of strings", "stop")
    return Job(
        prompt_ids=ids, max_tokens=max_tokens,
        temperature=float(_get(body, "temperature", (int, float), 1.0, lambda v: v >= 0, "must be >= 0")),
        top_p=float(_get(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "must be in (0, 1]")),
        top_k=_get(body, "top_k", (int,), 0, lambda v: v >= -1, "must be >= -1"),
        seed=_get(body, "seed", (int,)), stop=[s for s in stop or [] if s],
        ignore_eos=_get(body, "ignore_eos", (bool,), False))


def _cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the earliest stop string, and whether one was found."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of ``text`` could still begin a stop string (not safe to send)."""
    for k in range(min(len(text), max((len(s) for s in stops), default=1) - 1), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return k
    return 0


class _StopCheck:
    """A generate() stopping criterion: stop when ``job.cancel`` is set or a stop string appears."""

    def __init__(self, job: Job, tokenizer):
        self.job, self.tokenizer, self.cancelled = job, tokenizer, False
        # Enough tail tokens to spell any stop string, even at one byte per token.
        self.tail = 4 * max((len(s) for s in job.stop), default=0) + 4

    def __call__(self, input_ids, scores, **kwargs):
        done = self.job.cancel.is_set()
        self.cancelled |= done
        if not done and self.job.stop:
            start = max(len(self.job.prompt_ids), input_ids.shape[1] - self.tail)
            tail = self.tokenizer.decode(input_ids[0, start:], skip_special_tokens=True)
            done = any(s in tail for s in self.job.stop)
        return input_ids.new_full((input_ids.shape[0],), int(done)).bool()


class NaiveServer:
    """An HF causal LM and its tokenizer; ``run`` serializes generations behind one asyncio.Lock."""

    def __init__(self, model, tokenizer, model_id: str):
        self.model, self.tokenizer, self.model_id = model, tokenizer, model_id
        self.lock = asyncio.Lock()
        self.cancelled = 0  # generations stopped early because their client went away
        eos = model.generation_config.eos_token_id
        eos = tokenizer.eos_token_id if eos is None else eos
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.max_positions = getattr(model.config, "max_position_embeddings", None)

    @classmethod
    def load(cls, model: str = "default", dtype: str = "float32", threads: int | None = None,
             model_id: str | None = None, device: str = "cpu") -> "NaiveServer":
        """Resolve ``model`` like radixray does (a GGUF is converted once) and load it in eval mode."""
        import torch
        from transformers import AutoModelForCausalLM

        from radixray.engine.weights.loader import resolve_model
        if threads:
            torch.set_num_threads(threads)
        src = resolve_model(model)
        hf = AutoModelForCausalLM.from_pretrained(src.path, dtype=getattr(torch, dtype))
        hf = hf.to(device).eval()
        logger.info("naive server: %s loaded from %s (%s on %s, %d threads)", model, src.path,
                    dtype, device, torch.get_num_threads())
        return cls(hf, src.tokenizer, model_id or model)

    def generate(self, job: Job) -> Completion:
        """Blocking: one ``model.generate`` for ``job`` (feeds ``job.streamer`` if set).

        Stops at EOS (unless ``ignore_eos``), after ``max_tokens``, at a stop string, or
        soon after ``job.cancel`` is set. Not thread-safe: callers hold the lock.
        """
        import torch
        from transformers import StoppingCriteriaList

        ids = torch.tensor([job.prompt_ids], device=self.model.device)
        check = _StopCheck(job, self.tokenizer)
        kwargs = dict(max_new_tokens=job.max_tokens, do_sample=not job.greedy,
                      attention_mask=torch.ones_like(ids), streamer=job.streamer,
                      stopping_criteria=StoppingCriteriaList([check]),
                      pad_token_id=min(self.eos_ids) if self.eos_ids else None)
        if not job.greedy:
            kwargs.update(temperature=job.temperature, top_p=job.top_p, top_k=max(job.top_k, 0))
        if job.ignore_eos:
            kwargs["min_new_tokens"] = job.max_tokens
        if job.seed is not None:
            torch.manual_seed(job.seed)
        with torch.inference_mode():
            out = self.model.generate(ids, **kwargs)
        new = out[0, len(job.prompt_ids):].tolist()
        text, hit = _cut_at_stop(self.tokenizer.decode(new, skip_special_tokens=True), job.stop)
        eos = bool(new) and new[-1] in self.eos_ids and not job.ignore_eos
        return Completion(new, text, "stop" if hit or eos else "length", check.cancelled)

    async def run(self, job: Job) -> asyncio.Future:
        """Wait for the lock, start ``generate(job)`` in a thread and return its future.

        The lock is released when the thread ends, not when the caller stops waiting,
        so a vanished client cannot let two generations overlap; set ``job.cancel``
        to end its generation early.
        """
        await self.lock.acquire()
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(result: Completion | None, error: Exception | None) -> None:
            self.lock.release()
            self.cancelled += bool(result and result.cancelled)
            if done.done():  # the caller stopped waiting
                return
            if result is None:
                done.set_exception(error or RuntimeError("generation was interrupted"))
            else:
                done.set_result(result)

        def work() -> None:
            result, error = None, None
            try:
                result = self.generate(job)
            except Exception as e:
                logger.exception("generation failed")
                error = e
                if job.streamer is not None:
                    job.streamer.end()  # unblock the reader
            finally:
                loop.call_soon_threadsafe(settle, result, error)

        threading.Thread(target=work, name="naive-generate", daemon=True).start()
        return done


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status)


def _usage(job: Job, result: Completion) -> dict:
    n = len(result.token_ids)
    return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": n,
            "total_tokens": len(job.prompt_ids) + n}


def create_app(server: NaiveServer):
    """The OpenAI-compatible FastAPI app over ``server`` (kept on ``app.state.server``)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    app = FastAPI(title="radixray naive baseline")
    app.state.server = server

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_id, "object": "model",
                                            "created": 0, "owned_by": "radixray-naive"}]}

    async def handle(request: Request, chat: bool):
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not valid JSON")
        try:
            job = parse_job(body, chat, server.tokenizer, server.max_positions)
        except BadRequest as e:
            return _error(400, str(e), e.param)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": body.get("model") or server.model_id}
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_stream(server, job, head, chat, usage),
                                     media_type="text/event-stream")
        future = await server.run(job)
        try:
            result = await future
        except asyncio.CancelledError:
            job.cancel.set()
            raise
        except Exception as e:
            return _error(500, f"generation failed: {e}", kind="server_error")
        choice = {"index": 0, "finish_reason": result.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        return {**head, "object": "chat.completion" if chat else "text_completion",
                "choices": [choice], "usage": _usage(job, result)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


async def _stream(server: NaiveServer, job: Job, head: dict, chat: bool, include_usage: bool):
    """SSE events: one chunk per streamer piece, a finish chunk, optional usage, ``[DONE]``.

    Text that could be the start of a stop string is held back until it is known not
    to be. If the client disconnects, the generator is closed and ``job.cancel`` stops
    the model within one token.
    """
    from transformers import TextIteratorStreamer

    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(choices: list, **extra) -> str:
        return f"data: {json.dumps({**head, 'object': kind, 'choices': choices, **extra})}\n\n"

    def chunk(text: str | None, finish: str | None = None, role: bool = False) -> str:
        if not chat:
            return event([{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}])
        delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
        return event([{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}])

    job.streamer = TextIteratorStreamer(server.tokenizer, skip_prompt=True, skip_special_tokens=True)
    pieces = iter(job.streamer)
    try:
        future = await server.run(job)
        if chat:
            yield chunk(None, role=True)
        text, sent = "", 0
        while (piece := await asyncio.to_thread(next, pieces, None)) is not None:
            text, hit = _cut_at_stop(text + piece, job.stop)
            end = len(text) if hit else len(text) - _held_back(text, job.stop)
            if end > sent:
                yield chunk(text[sent:end])
                sent = end
            if hit:
                break
        try:
            result = await future
        except Exception as e:
            yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n"
            return
        if len(text) > sent:  # the held-back tail turned out not to be a stop string
            yield chunk(text[sent:])
        yield chunk(None, finish=result.finish_reason)
        if include_usage:
            yield event([], usage=_usage(job, result))
        yield "data: [DONE]\n\n"
    finally:
        job.cancel.set()  # a no-op once generation is over
