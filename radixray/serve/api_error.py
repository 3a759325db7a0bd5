"""The HTTP errors a client sees: :class:`ApiError` (an OpenAI-style error body) and the
mapping from validation and worker exceptions to it."""

from __future__ import annotations

from radixray.cluster.errors import (
    WorkerDraining,
    WorkerQueueFull,
    WorkerUnavailable,
    actor_unreachable,
)


class ApiError(Exception):
    """An error the client caused or must react to, rendered as an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


RESTART_RETRY_S = 2  # Retry-After while a fleet actor restarts (Ray restarts one in ~1.5 s)


def api_error_from(exc: BaseException) -> ApiError:
    """Map an exception from validation or the worker to the HTTP error the client sees."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValueError):
        return ApiError(400, str(exc))
    if isinstance(exc, WorkerQueueFull):
        return ApiError(503, str(exc), type="service_unavailable", code="queue_full",
                        headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, WorkerDraining):
        return ApiError(503, "the server is draining and takes no new requests; retry elsewhere",
                        type="service_unavailable", code="draining")
    if isinstance(exc, WorkerUnavailable):
        return ApiError(503, str(exc), type="service_unavailable", code="worker_unavailable")
    if actor_unreachable(exc):  # the controller (or another fleet actor) is restarting
        return ApiError(503, f"the fleet's controller is restarting; retry in a few seconds "
                        f"({type(exc).__name__})", type="service_unavailable",
                        code="fleet_restarting", headers={"Retry-After": str(RESTART_RETRY_S)})
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="internal_error")
