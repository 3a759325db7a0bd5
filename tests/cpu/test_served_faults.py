"""Fault isolation through the served app (one engine worker behind the controller, API
and admin keys on): legal extreme sampling values with the official openai client, a
fuzzer over the OpenAPI schema (bodies, parameters and headers, the Authorization
header included), one faulty forward pass, and faults on every step (the worker is
restarted once, then stays down and /health says why).

The tests run in file order and the last one leaves the fleet down on purpose.
"""

import re
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from serving_helpers import free_port, metric, served, tiny_config

from radixray.engine.faults import FailForwards, FaultInjector
from radixray.serve.auth import AuthPolicy

RESTART_DEADLINE_S = 120.0
API_KEY, ADMIN_KEY = "sk-fuzz-api-0123456789", "sk-fuzz-admin-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
INVALID_ONLY = ("^/fleet/workers/|^/pause_generation|^/init_weights_update_group"
                "|^/update_weights_from_")
CONFIG: dict = {}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    CONFIG.update(tiny_config(tiny_llama_dir, free_port(), api_key=API_KEY,
                              admin_api_key=ADMIN_KEY))
    # A short context bounds the fuzzer's work: no request can ask for more than 96 tokens.
    CONFIG["engine"].update(context_length=96, max_consecutive_failed_steps=2)
    CONFIG["fleet"] = {"workers": 1, "health_check_interval_s": 0.5, "max_restarts": 1}
    CONFIG["router"] = {"retry_backoff_s": 0.05}
    with served(CONFIG) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


def _worker():
    """Worker-0's current actor handle, from the controller."""
    import ray

    from radixray.cluster.config import ServeConfig
    from radixray.serve.fleet import find_controller
    controller = find_controller(ServeConfig.parse(CONFIG))
    return ray.get(controller.worker.remote("worker-0")).handle


def _record(base: str) -> dict:
    return httpx.get(f"{base}/fleet", headers=ADMIN, timeout=60).json()["workers"][0]


def _kv_whole(base: str) -> None:
    kv = httpx.get(f"{base}/debug/kv_conservation", headers=ADMIN, timeout=60)
    assert kv.status_code == 200, kv.text
    w = kv.json()["worker-0"]
    assert w["running"] == 0 and w["waiting"] == 0 and w["free"] + w["cached"] == w["pool"]


def test_extreme_legal_sampling_values_through_the_openai_client(server, client):
    """The issue's calls: top_p=5e-324 used to kill the scheduler, and the next request hung."""
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=4, top_p=5e-324)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4,
        extra_body={"repetition_penalty": 5e-324, "ignore_eos": True})
    assert chat.usage.completion_tokens == 4
    again = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    assert again.choices[0].text and again.usage.completion_tokens >= 1


# The Authorization header a fuzzed request carries (the admin key most often, so most
# cases reach their route), and other headers beside the operation's own.
AUTHORIZATIONS = [f"Bearer {ADMIN_KEY}"] * 4 + [f"Bearer {API_KEY}", None, "Bearer wrong-key",
                                                "Basic dXNlcjpwYXNz", "Bearer", "bearer " + ADMIN_KEY]
HEADER_TEXT = st.from_regex(r"\A([!-~]([ -~]{0,38}[!-~])?)?\Z")  # what a client may send
EXTRA_HEADERS = st.dictionaries(
    st.sampled_from(["X-Session-Id", "Accept", "Accept-Encoding", "Content-Type", "X-Request-Id",
                     "User-Agent", "X-Forwarded-For", "Cookie"]) | st.from_regex(
        r"\AX-[A-Za-z0-9-]{1,20}\Z"), HEADER_TEXT, max_size=4)


def _expected_refusal(path: str, authorization: str | None) -> int | None:
    """401 when ``authorization`` does not open ``path`` (the ingress's own policy decides)."""
    refusal = AuthPolicy(API_KEY, ADMIN_KEY).refusal(path, authorization)
    return refusal[0] if refusal else None


def _fuzz(base: str, max_examples: int) -> int:
    """Send schemathesis' valid and invalid cases for every operation of the app's OpenAPI
    schema, each with a drawn Authorization header and extra headers; assert none gets a
    5xx and every one without the right key gets its 401. Returns how many went out."""
    from hypothesis import given
    from hypothesis.errors import Unsatisfiable
    # Invalid cases only for: drain/resume (draining the only worker is a 503 by design),
    # pause_generation (a paused fleet holds every later request until continued), and the
    # RL weight endpoints (keep_paused holds it too; a weight-update group waits for its
    # trainer to join). Their invalid cases are refused before anything happens.
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json", headers=ADMIN)
    sent = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        modes = list(schemathesis.GenerationMode)
        if re.match(INVALID_ONLY, operation.path):
            modes = [schemathesis.GenerationMode.NEGATIVE]
        for mode in modes:
            @settings(max_examples=max_examples, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode),
                   authorization=st.sampled_from(AUTHORIZATIONS), extra=EXTRA_HEADERS)
            def call(case, authorization, extra):
                nonlocal sent
                headers = {**extra, **(case.headers or {})}
                headers.pop("Authorization", None)
                if authorization is not None:
                    headers["Authorization"] = authorization
                case.headers = headers
                response = case.call(base_url=base, timeout=120)
                sent += 1
                what = (f"{case.method} {case.formatted_path} {headers} {case.body!r} -> "
                        f"{response.status_code} {response.text[:500]}")
                assert response.status_code < 500, what
                refused = _expected_refusal(case.formatted_path, authorization)
                if refused is not None:
                    assert response.status_code == refused, what
            try:
                call()
            except Unsatisfiable:  # nothing to make invalid (no parameters, no body)
                assert mode is schemathesis.GenerationMode.NEGATIVE, operation.label
    print(f"fuzzer: {sent} requests")  # the figure docs/reliability.md reports (-s)
    return sent


def test_fuzzed_requests_get_no_server_error(server):
    assert _fuzz(server, max_examples=10) > 100


@pytest.mark.slow
def test_fuzzed_requests_get_no_server_error_long(server):
    assert _fuzz(server, max_examples=150) > 1000


def test_still_serving_after_the_fuzzer(server, client):
    r = client.completions.create(model="tiny", prompt="still here", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1
    assert httpx.get(f"{server}/health", timeout=60).status_code == 200
    for _ in range(200):  # streams the fuzzer dropped are aborted asynchronously
        kv = httpx.get(f"{server}/debug/kv_conservation", headers=ADMIN,
                       timeout=60).json()["worker-0"]
        if kv["running"] == 0 and kv["waiting"] == 0:
            break
        time.sleep(0.1)
    _kv_whole(server)


def test_one_faulty_forward_fails_only_its_batch(server, client):
    import ray
    from openai import InternalServerError
    ray.get(_worker().attach_fault_injector.remote(
        FaultInjector(FailForwards(1, "boom in one forward"))))
    with pytest.raises(InternalServerError) as err:
        client.completions.create(model="tiny", prompt="unlucky", max_tokens=3)
    assert err.value.status_code == 500 and "InjectedFault: boom in one forward" in str(err.value)
    _kv_whole(server)
    r = client.completions.create(model="tiny", prompt="lucky", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1
    page = httpx.get(f"{server}/metrics", timeout=60).text
    assert metric(page, "radixray:failed_steps_total") == 1
    assert metric(page, "radixray:requests_total", finish_reason="error") == 1
    assert metric(page, "radixray:engine_failed") == 0
    assert _record(server)["generation"] == 0  # one bad batch restarts nothing


def _fail_every_step(base: str, client) -> None:
    """Make every forward pass of the current worker raise and send requests until its
    engine gives up (two failed steps in a row)."""
    import ray
    from openai import APIStatusError
    ray.get(_worker().attach_fault_injector.remote(FaultInjector(FailForwards(-1))))
    for _ in range(2):
        with pytest.raises(APIStatusError) as err:
            client.completions.create(model="tiny", prompt="doomed", max_tokens=3)
        assert err.value.status_code in (500, 503), err.value


def test_faults_on_every_step_restart_the_worker_then_it_stays_down(server, client):
    _fail_every_step(server, client)
    deadline = time.monotonic() + RESTART_DEADLINE_S
    while not (_record(server)["generation"] == 1 and _record(server)["state"] == "ready"):
        assert time.monotonic() < deadline, _record(server)
        time.sleep(0.25)
    rec = _record(server)
    assert rec["restarts"] == 1 and "2 scheduler steps failed in a row" in rec["error"]
    r = client.completions.create(model="tiny", prompt="after the restart", max_tokens=3)
    assert r.usage.completion_tokens >= 1
    assert httpx.get(f"{server}/health", timeout=60).status_code == 200

    # Its restart budget (fleet.max_restarts: 1) is spent: the next failure is final.
    _fail_every_step(server, client)
    while _record(server)["state"] != "failed":
        assert time.monotonic() < deadline, _record(server)
        time.sleep(0.25)
    health = httpx.get(f"{server}/health", timeout=60)
    assert health.status_code == 503
    body = health.json()
    assert body["status"] == "unavailable" and body["workers"]["failed"] == 1
    assert "scheduler steps failed in a row" in body["errors"]["worker-0"]
    probe = httpx.get(f"{server}/health_generate", timeout=60)
    assert probe.status_code == 503 and probe.json()["status"] == "unavailable"
    refused = httpx.post(f"{server}/generate", timeout=60, headers=ADMIN, json={"text": "anyone?",
                                                              "sampling_params": {"max_new_tokens": 2}})
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "service_unavailable"
