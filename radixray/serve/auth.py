"""API and admin keys on the HTTP front.

Every route is in one of three tiers, decided by its path:

- open (``server.open_routes``; default the probes and ``/metrics``): no key;
- the serving APIs (:data:`API_ROUTES`: OpenAI and native generation, the model list,
  the OpenAPI schema and its pages):
  the API key (``server.api_key`` / ``RADIXRAY_API_KEY``) or the admin key; open when
  no API key is set;
- everything else, i.e. every control route (cache flush, fleet drain/resume/router,
  debug, the RL control plane's weight, pause and memory routes) and any route added
  later: the admin key (``server.admin_api_key`` / ``RADIXRAY_ADMIN_API_KEY``). Without
  an admin key they answer only when the server binds to loopback.

Keys come as ``Authorization: Bearer <key>`` and are compared in constant time. A
missing or wrong key is a 401 with an OpenAI-style body; a control route on a
non-loopback server without an admin key is a 403 saying which field to set. Keys are
pydantic ``SecretStr`` everywhere, so no log or repr of the config shows them.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass

from radixray.cluster.config import DEFAULT_OPEN_ROUTES

API_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/generate",
                        "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass(frozen=True)
class AuthPolicy:
    """What one ingress replica asks of each request (see the module docstring)."""

    api_key: str | None = None
    admin_api_key: str | None = None
    open_routes: frozenset[str] = frozenset(DEFAULT_OPEN_ROUTES)
    loopback: bool = True  # the server binds to loopback only

    @classmethod
    def from_server(cls, server) -> AuthPolicy:
        """From a ``ServerSection`` (keys already resolved from the environment)."""
        def secret(value):
            return value.get_secret_value() if value is not None else None
        return cls(secret(server.api_key), secret(server.admin_api_key),
                   frozenset(server.open_routes), server.host in LOOPBACK_HOSTS)

    def tier(self, path: str) -> str:
        """``open``, ``api`` or ``admin``."""
        if path in self.open_routes:
            return "open"
        return "api" if path in API_ROUTES else "admin"

    def refusal(self, path: str, authorization: str | None) -> tuple[int, str, str] | None:
        """None if the request may go on, else (status, message, code)."""
        tier = self.tier(path)
        if tier == "open":
            return None
        given = _bearer(authorization)
        if self.admin_api_key is not None and _equal(given, self.admin_api_key):
            return None
        if tier == "api":
            if self.api_key is None or _equal(given, self.api_key):
                return None
            return 401, _missing_or_wrong(given, "an API key (server.api_key)"), "invalid_api_key"
        if self.admin_api_key is None:
            if self.loopback:
                return None
            return (403, f"{path} is a control route: set server.admin_api_key (or "
                    f"RADIXRAY_ADMIN_API_KEY) to use it on a server that does not bind to "
                    f"loopback only", "admin_key_not_configured")
        return 401, _missing_or_wrong(given, "the admin key (server.admin_api_key)"), \
            "invalid_admin_key"


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _equal(given: str | None, key: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), key.encode())


def _missing_or_wrong(given: str | None, what: str) -> str:
    if given is None:
        return f"this route needs {what}: send it as 'Authorization: Bearer <key>'"
    return f"the key sent in the Authorization header is not {what}"


_POLICY: AuthPolicy | None = None


def install_policy(policy: AuthPolicy) -> None:
    """This process' policy (one ingress replica per process)."""
    global _POLICY
    _POLICY = policy


def replica_policy() -> AuthPolicy | None:
    """The installed policy; callers outside this module go through here (Serve ships the
    ingress class to its replica pickled by value: a name bound at import would be a copy)."""
    return _POLICY


class AuthMiddleware:
    """Pure ASGI middleware applying :class:`AuthPolicy` before any route runs. With no
    policy given or installed it lets everything through (a bare app in a test)."""

    def __init__(self, app, policy: AuthPolicy | None = None):
        self.app = app
        self.policy = policy

    async def __call__(self, scope, receive, send):
        policy = self.policy or replica_policy()
        if scope["type"] != "http" or policy is None or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        authorization = next((v.decode("latin-1") for k, v in scope.get("headers", ())
                              if k == b"authorization"), None)
        refused = policy.refusal(path, authorization)
        if refused is None:
            await self.app(scope, receive, send)
            return
        status, message, code = refused
        body = json.dumps({"error": {"message": message, "type": "authentication_error"
                                     if status == 401 else "permission_error",
                                     "param": None, "code": code}}).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="radixray"'))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
