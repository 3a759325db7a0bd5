"""API and admin keys (serve/auth.py) on the real ingress app's routes, without Ray: the
key check answers before any route runs, so every route can be enumerated here and a
route added later without protection fails this file."""

import os

import pytest
from fastapi.testclient import TestClient
from starlette.routing import Route

from radixray.cluster.config import ConfigError, ServeConfig
from radixray.serve import auth
from radixray.serve.auth import AuthPolicy
from radixray.serve.ingress import app

API_KEY, ADMIN_KEY = "sk-api-0123456789", "sk-admin-0123456789"


def _routes() -> list[tuple[str, str]]:
    """(method, concrete path) of every route the app serves: its OpenAPI schema's (Serve
    moves the class's routes into an included router) and FastAPI's own pages."""
    out = [(method.upper(), path.replace("{worker_id}", "worker-0"))
           for path, methods in app.openapi()["paths"].items() for method in methods]
    out += [(m, r.path) for r in app.routes if isinstance(r, Route)
            for m in sorted(r.methods or ()) if m != "HEAD"]
    assert len(out) > 25, out
    return out


ROUTES = _routes()


@pytest.fixture
def client_with():
    """A TestClient on the ingress app under a given policy (restored afterwards)."""
    before = auth.replica_policy()

    def make(policy: AuthPolicy) -> TestClient:
        auth.install_policy(policy)
        return TestClient(app, raise_server_exceptions=False)
    yield make
    auth.install_policy(before)


def _send(client, method, path, key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.request(method, path, headers=headers, json={} if method == "POST" else None)


def test_every_route_is_in_a_tier_and_the_tiers_are_what_the_issue_names():
    policy = AuthPolicy()
    tiers = {path: policy.tier(path) for _, path in ROUTES}
    assert {p for p, t in tiers.items() if t == "open"} == {"/health", "/health_generate",
                                                           "/ready", "/metrics"}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/generate"} <= {
        p for p, t in tiers.items() if t == "api"}
    for control in ("/flush_cache", "/fleet", "/fleet/workers/worker-0/drain",
                    "/fleet/workers/worker-0/resume", "/fleet/router", "/debug/kv_conservation",
                    "/pause_generation", "/continue_generation", "/release_memory_occupation",
                    "/resume_memory_occupation", "/update_weights_from_disk",
                    "/init_weights_update_group", "/update_weights_from_distributed",
                    "/destroy_weights_update_group", "/get_weight_version", "/abort_request"):
        assert tiers[control] == "admin", control
    assert policy.tier("/a/route/added/later") == "admin"


@pytest.mark.parametrize("method,path", [r for r in ROUTES if AuthPolicy().tier(r[1]) != "open"])
def test_a_request_without_the_key_gets_401_on_every_protected_route(client_with, method, path):
    client = client_with(AuthPolicy(API_KEY, ADMIN_KEY, loopback=False))
    r = _send(client, method, path)
    assert r.status_code == 401, (method, path, r.status_code, r.text)
    error = r.json()["error"]
    assert error["type"] == "authentication_error" and "Authorization: Bearer" in error["message"]
    assert r.headers["www-authenticate"].startswith("Bearer")
    wrong = _send(client, method, path, key="sk-not-the-key")
    assert wrong.status_code == 401 and "is not" in wrong.json()["error"]["message"]
    if AuthPolicy().tier(path) == "admin":  # the API key opens no control route
        assert _send(client, method, path, key=API_KEY).status_code == 401
        assert "server.admin_api_key" in _send(client, method, path, API_KEY).json()[
            "error"]["message"]


def test_the_right_key_passes_the_check(client_with):
    client = client_with(AuthPolicy(API_KEY, ADMIN_KEY, loopback=False))
    for method, path in ROUTES:
        tier = AuthPolicy().tier(path)
        keys = {"open": [None], "api": [API_KEY, ADMIN_KEY], "admin": [ADMIN_KEY]}[tier]
        for key in keys:  # past the check the route runs (outside Serve it may fail: not 401)
            assert _send(client, method, path, key).status_code not in (401, 403), (path, key)


def test_control_routes_need_an_admin_key_unless_the_server_binds_to_loopback(client_with):
    remote = client_with(AuthPolicy(loopback=False))
    r = _send(remote, "POST", "/flush_cache")
    assert r.status_code == 403 and "server.admin_api_key" in r.json()["error"]["message"]
    assert _send(remote, "POST", "/v1/completions").status_code not in (401, 403)  # API open
    local = client_with(AuthPolicy(loopback=True))
    assert _send(local, "POST", "/flush_cache").status_code not in (401, 403)


def test_keys_come_from_flags_or_the_environment_and_never_show(monkeypatch):
    monkeypatch.setenv("RADIXRAY_API_KEY", API_KEY)
    monkeypatch.setenv("RADIXRAY_ADMIN_API_KEY", ADMIN_KEY)
    cfg = ServeConfig.parse({"server": {"host": "0.0.0.0"}})
    policy = AuthPolicy.from_server(cfg.server)
    assert (policy.api_key, policy.admin_api_key, policy.loopback) == (API_KEY, ADMIN_KEY, False)
    for text in (repr(cfg), str(cfg.model_dump()), cfg.model_dump_json()):
        assert API_KEY not in text and ADMIN_KEY not in text
    given = ServeConfig.parse({"server": {"api_key": "sk-from-config-1"}})
    assert given.server.api_key.get_secret_value() == "sk-from-config-1"  # config wins
    monkeypatch.delenv("RADIXRAY_API_KEY")
    with pytest.raises(ConfigError, match="server.api_key must be at least 8 characters"):
        ServeConfig.parse({"server": {"api_key": "short"}})
    assert "short" not in str(os.environ)


def test_serve_cli_flags_set_the_keys():
    import argparse

    from radixray.serve import serve_cli
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY])
    cfg = serve_cli.config_from_args(args)
    assert cfg.server.api_key.get_secret_value() == API_KEY
    assert cfg.server.admin_api_key.get_secret_value() == ADMIN_KEY
