"""How the HTTP app answers what no route answers itself: validation errors as 400s that
name the field (and refuse unknown fields by name), API errors with their status, bodies over
the limit as 413s, anything unexpected as an OpenAI-style error body (a restarting fleet actor
logged as a warning, not a traceback), and POST bodies read as JSON whatever their
Content-Type. :func:`install_error_handlers` registers all of it on the app.
"""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from radixray.cluster.errors import actor_unreachable
from radixray.serve.api_error import ApiError, api_error_from
from radixray.serve.limits import BodyTooLarge

logger = logging.getLogger("radixray.ingress")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return f"Malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}", None
        where = ".".join(loc) or "body"
        param = param or where
        if err.get("type") == "extra_forbidden":
            parts.append(f"{where}: this server does not implement this field; it is refused "
                         f"rather than ignored (remove it)")
        else:
            parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts) or "invalid request", param


class JsonWithoutContentType:
    """Pure ASGI middleware: POST bodies are read as JSON whatever their Content-Type
    (``curl -d`` sends a form type), as SGLang's endpoints do; a body that is not JSON still
    gets the malformed-JSON 400. It only rewrites the request's headers, so a streamed
    response passes through untouched (``app.middleware("http")`` would relay every chunk
    through a task and a memory stream of its own, a cost paid per streamed token)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("method") == "POST":
            headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-type"]
            scope = {**scope, "headers": headers + [(b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


async def _on_validation_error(request: Request, exc: RequestValidationError):
    message, param = _validation_message(exc)
    return JSONResponse(ApiError(400, message, param=param).body(), status_code=400)


async def _on_api_error(request: Request, exc: ApiError):
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _on_body_too_large(request: Request, exc: BodyTooLarge):
    return JSONResponse(exc.body(), status_code=413)


async def _on_unexpected(request: Request, exc: Exception):
    if actor_unreachable(exc):
        logger.warning("%s: a fleet actor is restarting: %s", request.url.path, exc)
    else:
        logger.exception("unexpected error on %s", request.url.path)
    err = api_error_from(exc)
    return JSONResponse(err.body(), status_code=err.status)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers and the JSON-body middleware of this module on ``app``."""
    app.add_middleware(JsonWithoutContentType)
    app.exception_handler(RequestValidationError)(_on_validation_error)
    app.exception_handler(ApiError)(_on_api_error)
    app.exception_handler(BodyTooLarge)(_on_body_too_large)
    app.exception_handler(Exception)(_on_unexpected)
