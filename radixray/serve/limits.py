"""Bounds on one request, from the server section of the config.

:class:`RequestLimits` checks what a request asks for (choices, stop strings, top
logprobs) before anything is tokenized or scheduled; each refusal is a 400 naming the
request field, the bound and the config field that sets it. :class:`BodySizeLimit`
refuses a body over ``server.max_request_body_bytes`` with a 413, from its
Content-Length at once or, for a chunked body, as soon as the bytes read pass it.
The prompt's length is bounded by the model's context (Frontend.check_prompt) and the
queue by ``server.max_queued_requests`` (EngineWorker.submit).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from starlette.exceptions import HTTPException

from radixray.serve.api_error import ApiError


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 64
    max_stop_sequences: int = 16
    max_top_logprobs: int = 20

    @classmethod
    def from_server(cls, server) -> RequestLimits:
        return cls(server.max_n, server.max_stop_sequences, server.max_top_logprobs)

    def check(self, param: str, value: int | None, bound: int, field: str, what: str) -> None:
        if value is not None and value > bound:
            raise ApiError(400, f"{param} is {value}; at most {bound} {what} per request "
                           f"(server.{field})", param=param)

    def check_openai(self, req, logprobs_param: str) -> None:
        """A /v1/completions or /v1/chat/completions body; ``logprobs_param`` names its
        top-logprobs field (``logprobs`` or ``top_logprobs``)."""
        self.check("n", req.n, self.max_n, "max_n", "choices")
        stops = [req.stop] if isinstance(req.stop, str) else req.stop
        self.check("stop", len(stops) if stops else None, self.max_stop_sequences,
                   "max_stop_sequences", "stop sequences")
        self.check(logprobs_param, getattr(req, logprobs_param), self.max_top_logprobs,
                   "max_top_logprobs", "top logprobs")

    def check_native(self, req) -> None:
        """A /generate body (its sampling_params are a dict checked by the engine's parser)."""
        sp = req.sampling_params or {}
        n = sp.get("n")
        self.check("sampling_params.n", n if isinstance(n, int) else None, self.max_n,
                   "max_n", "choices")
        stop = sp.get("stop")
        stops = [stop] if isinstance(stop, str) else stop
        self.check("sampling_params.stop", len(stops) if isinstance(stops, list) else None,
                   self.max_stop_sequences, "max_stop_sequences", "stop sequences")
        self.check("top_logprobs_num", req.top_logprobs_num, self.max_top_logprobs,
                   "max_top_logprobs", "top logprobs")


class BodyTooLarge(HTTPException):
    """Raised while a chunked body is read past the limit (FastAPI passes HTTPExceptions
    through its body parsing; the app's handler renders :meth:`body`)."""

    def __init__(self, limit: int):
        super().__init__(413)
        self.limit = limit

    def body(self) -> dict:
        return {"error": {"message": f"the request body is larger than {self.limit} bytes "
                          f"(server.max_request_body_bytes)", "type": "invalid_request_error",
                          "param": None, "code": "request_too_large"}}


class BodySizeLimit:
    """Pure ASGI middleware: 413 for a request body over ``max_bytes`` (None: this
    process' installed limit, see :func:`install_body_limit`; unset lets all through)."""

    def __init__(self, app, max_bytes: int | None = None):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        limit = self.max_bytes or _BODY_LIMIT
        if scope["type"] != "http" or limit is None:
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > limit:
            body = json.dumps(BodyTooLarge(limit).body()).encode()
            await send({"type": "http.response.start", "status": 413, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        seen = 0

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message
        await self.app(scope, counting_receive, send)


_BODY_LIMIT: int | None = None


def install_body_limit(max_bytes: int) -> None:
    """This process' body limit (one ingress replica per process)."""
    global _BODY_LIMIT
    _BODY_LIMIT = max_bytes
