"""Direct ingress planning: which ports a local Serve instance publishes, and the Ray Serve
environment that makes its ingress replicas listen on them (the end-to-end path is
test_serve_cli.py's drain test, which runs in direct mode)."""

import os
import subprocess
import sys

import pytest

from radixray.serve.ingress_mode import plan_ingress, resolve_mode


def test_auto_is_direct_for_one_ingress_replica_and_proxy_for_several():
    assert resolve_mode("auto", 1) == "direct"
    assert resolve_mode("auto", 3) == "proxy"
    assert resolve_mode("direct", 3) == "direct" and resolve_mode("proxy", 1) == "proxy"


def test_direct_plan_publishes_the_replica_ports_and_moves_the_proxy_away():
    plan = plan_ingress("direct", 8000, 2, "127.0.0.1")
    assert plan.mode == "direct" and plan.ports == (8000, 8001)
    assert plan.proxy_port not in (8000, 8001)
    env = plan.env
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    # Serve's port allocator hands out [min, max)
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == ("8000", "8002")
    assert float(env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"]) <= 5


def test_proxy_plan_sets_nothing():
    plan = plan_ingress("auto", 8000, 2, "127.0.0.1")
    assert plan.mode == "proxy" and plan.ports == (8000,) and plan.proxy_port == 8000
    assert plan.env == {}


def test_ports_past_65535_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="server.port 65535 leaves no room for 2"):
        plan_ingress("direct", 65535, 2, "127.0.0.1")


def test_serve_reads_the_plan_when_it_is_imported():
    """The variables are the ones Ray Serve's constants read (a fresh interpreter)."""
    env = {**os.environ, **plan_ingress("direct", 8100, 1, "127.0.0.1").env}
    code = ("from ray.serve._private import constants as c; "
            "print(c.RAY_SERVE_ENABLE_DIRECT_INGRESS, c.RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT, "
            "c.RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT, c.RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["True", "8100", "8101", "1.0"]


def test_prepare_local_ray_sets_a_tolerant_proxy_readiness(monkeypatch):
    from radixray.serve.ingress_mode import LOCAL_PROXY_READY_TIMEOUT_S, prepare_local_ray
    env = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "7"}
    monkeypatch.setattr(os, "environ", env)  # nothing leaks into this test process's Ray
    plan = plan_ingress("proxy", 8200, 1, "127.0.0.1")
    prepare_local_ray(plan)
    assert env == {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "7"}  # the user's own value stays
    del env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"]
    prepare_local_ray(plan)
    assert float(env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"]) == LOCAL_PROXY_READY_TIMEOUT_S


def test_direct_ingress_is_refused_once_serve_was_imported_without_it(monkeypatch):
    import ray.serve  # noqa: F401 - imported here without the direct-ingress variables

    from radixray.serve.ingress_mode import prepare_local_ray
    env: dict = {}
    monkeypatch.setattr(os, "environ", env)
    with pytest.raises(RuntimeError, match="before ray.serve is imported"):
        prepare_local_ray(plan_ingress("direct", 8200, 1, "127.0.0.1"))
    assert env == {}


def test_serve_start_is_retried_when_its_proxy_was_replaced():
    import ray

    from radixray.serve.serve_cli import start_serve

    class FlakyServe:
        calls = 0

        def start(self, http_options):
            self.calls += 1
            if self.calls == 1:
                raise ray.exceptions.ActorDiedError()
            assert http_options == {"host": "127.0.0.1", "port": 8300}

    serve = FlakyServe()
    start_serve(serve, "127.0.0.1", 8300)
    assert serve.calls == 2
    always = FlakyServe()
    always.start = lambda http_options: (_ for _ in ()).throw(ray.exceptions.ActorDiedError())
    with pytest.raises(ray.exceptions.ActorDiedError):
        start_serve(always, "127.0.0.1", 8300, attempts=2)
