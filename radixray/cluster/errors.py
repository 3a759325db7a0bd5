"""Errors that cross the worker/ingress boundary (they must pickle through Ray)."""

from __future__ import annotations


class WorkerDraining(RuntimeError):
    """The worker finishes what it has and takes no new requests (HTTP 503)."""


class WorkerQueueFull(WorkerDraining):
    """The worker's queue of requests waiting for admission is at server.max_queued_requests:
    it refuses new ones at once (HTTP 503 with Retry-After) instead of queueing them for
    minutes. A WorkerDraining, so dispatchers try another worker first."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # through Ray: keep retry_after_s
        return type(self), (str(self), self.retry_after_s)


class WorkerUnavailable(RuntimeError):
    """The worker cannot be reached (dead, not started, stream closed) (HTTP 503)."""


def unwrap_ray_error(exc: BaseException) -> BaseException:
    """The user-level exception inside a RayTaskError/RayActorError, or ``exc`` itself."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        return cause
    try:
        import ray.exceptions
    except ImportError:  # pragma: no cover - ray is a dependency
        return exc
    if isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
        return WorkerUnavailable(f"the engine worker is unavailable: {exc}")
    return exc


def actor_unreachable(exc: BaseException) -> bool:
    """Whether a call failed because the actor itself is dead or restarting (not because
    the method raised)."""
    try:
        from ray.exceptions import ActorUnavailableError, RayActorError
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return isinstance(exc, (RayActorError, ActorUnavailableError))
