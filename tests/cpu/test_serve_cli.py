"""`radixray serve` as users run it (direct ingress: HTTP straight into the ingress replica):
the APIs, a disconnect returning its KV, SIGTERM draining. `serve run`, `serve deploy` and
`ray job submit`: tests/cpu/test_deploy_run.py."""

import os
import signal
import threading
import time

import httpx
import pytest
from serving_helpers import (
    assert_disconnect_returns_kv,
    free_port,
    metric,
    start_radixray_serve,
    wait_ready,
)

API_KEY, ADMIN_KEY = "sk-test-api-key-1", "sk-test-admin-key-1"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _check_keys(base: str) -> None:
    """--api-key / --admin-api-key through the real server: the probes and /metrics stay
    open, the API takes either key, control routes only the admin key."""
    from openai import AuthenticationError, OpenAI
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/metrics").status_code == 200
    no_key = httpx.post(f"{base}/generate", json={"text": "hi"})
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    api = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(f"{base}/flush_cache", headers=api).status_code == 401
    assert httpx.post(f"{base}/flush_cache", headers=ADMIN).status_code == 200
    try:
        OpenAI(base_url=f"{base}/v1", api_key="sk-wrong-key", max_retries=0).models.list()
        raise AssertionError("a wrong key was accepted")
    except AuthenticationError as exc:
        assert exc.status_code == 401


def _check_direct_ingress_serving(base: str) -> None:
    """What the proxied app does (test_serving_api.py), on the CLI's direct-ingress path:
    the openai client streams, bad input is a 400 naming the field, a repeated prompt is
    cached, a disconnect aborts its request and returns its KV."""
    from openai import BadRequestError, OpenAI
    client = OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
    chat = [{"role": "user", "content": "the cat sat on the mat"}]
    stream = client.chat.completions.create(model="tiny", messages=chat, max_tokens=8,
                                            temperature=0, stream=True)
    assert len([c for c in stream if c.choices and c.choices[0].delta.content]) >= 1
    again = client.chat.completions.create(model="tiny", messages=chat, max_tokens=8,
                                           temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    try:
        client.chat.completions.create(model="tiny", messages=chat, max_tokens=-1)
        raise AssertionError("negative max_tokens was accepted")
    except BadRequestError as exc:
        assert exc.status_code == 400 and "max_tokens" in str(exc)
    assert_disconnect_returns_kv(base, ADMIN)


def _wait_for_line(path, text: str, proc, timeout: float = 300) -> None:
    """Until ``text`` is in the log at ``path``; fails if the process exits first."""
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert proc.poll() is None, f"exited {proc.returncode}: {path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} in {timeout} s"
        time.sleep(0.1)


@pytest.mark.slow  # ~35 s: out of the quick run's 15-minute budget
def test_sigterm_to_the_process_group_drains_in_flight_request_then_exits_zero(
        tiny_llama_dir, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w")
    # in a process group of its own, signalled whole below
    proc = start_radixray_serve(tiny_llama_dir, port, log, "--api-key", API_KEY,
                                env={"RADIXRAY_ADMIN_API_KEY": ADMIN_KEY})
    try:
        wait_ready(base)
        # The CLI prints its ready line after its own /ready poll sees 200, which can come
        # after ours: a SIGTERM before it would (rightly) skip the line this test reads.
        _wait_for_line(tmp_path / "serve.log", "radixray is ready", proc)
        _check_keys(base)
        _check_direct_ingress_serving(base)
        result = {}

        def long_request():
            result["r"] = httpx.post(f"{base}/generate", timeout=300, headers=ADMIN, json={
                "text": "the cat", "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}})
        t = threading.Thread(target=long_request)
        t.start()
        while metric(httpx.get(f"{base}/metrics").text, "radixray:num_running_reqs") < 1:
            time.sleep(0.05)
        # SIGTERM to the whole group, as `timeout`, container inits and service managers
        # send it: Ray's own processes must survive it until the drain is over
        os.killpg(proc.pid, signal.SIGTERM)
        statuses = set()
        refused = None
        while t.is_alive():
            statuses.add(httpx.get(f"{base}/health", timeout=10).status_code)
            if 503 in statuses and refused is None:
                refused = httpx.post(f"{base}/generate", json={"text": "hi"}, headers=ADMIN,
                                     timeout=10)
            time.sleep(0.05)
        t.join()
        assert 503 in statuses, statuses
        assert refused is not None and refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        r = result["r"]
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] == 1000
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "Gracefully exiting" in text
    assert API_KEY not in text and ADMIN_KEY not in text  # keys never reach a log
    # one ingress replica: HTTP goes straight into it, Serve's proxy idles on another port
    assert f"ingress: direct on port {port} (Serve's proxy idles on" in text, text
    assert f"radixray is ready: {base}  (model \"tiny\", direct ingress)" in text, text
