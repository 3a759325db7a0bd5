"""`radixray serve` as users run it (direct ingress: HTTP straight into the ingress replica):
the APIs, a disconnect returning its KV, SIGTERM draining; `ray job submit` against a local head."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serving_helpers import RAY_ENV, assert_disconnect_returns_kv, free_port, metric, wait_ready

ENV = {**os.environ, **RAY_ENV}
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def _check_direct_ingress_serving(base: str) -> None:
    """What the proxied app does (test_serving_api.py), on the CLI's direct-ingress path:
    the openai client streams, bad input is a 400 naming the field, a repeated prompt is
    cached, a disconnect aborts its request and returns its KV."""
    from openai import BadRequestError, OpenAI
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
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
    assert_disconnect_returns_kv(base)


def _wait_for_line(path, text: str, proc, timeout: float = 300) -> None:
    """Until ``text`` is in the log at ``path``; fails if the process exits first."""
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert proc.poll() is None, f"exited {proc.returncode}: {path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} in {timeout} s"
        time.sleep(0.1)


def test_sigterm_drains_in_flight_request_then_exits_zero(tiny_llama_dir, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixray.cli", "serve", "--model", tiny_llama_dir, "--port",
         str(port), "--dtype", "float32", "--max-total-tokens", "4096", "--num-cpus", "2",
         "--served-model-name", "tiny"], stdout=log, stderr=subprocess.STDOUT, env=ENV)
    try:
        wait_ready(base)
        # The CLI prints its ready line after its own /ready poll sees 200, which can come
        # after ours: a SIGTERM before it would (rightly) skip the line this test reads.
        _wait_for_line(tmp_path / "serve.log", "radixray is ready", proc)
        _check_direct_ingress_serving(base)
        result = {}

        def long_request():
            result["r"] = httpx.post(f"{base}/generate", timeout=300, json={
                "text": "the cat", "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}})
        t = threading.Thread(target=long_request)
        t.start()
        while metric(httpx.get(f"{base}/metrics").text, "radixray:num_running_reqs") < 1:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        statuses = set()
        refused = None
        while t.is_alive():
            statuses.add(httpx.get(f"{base}/health", timeout=10).status_code)
            if 503 in statuses and refused is None:
                refused = httpx.post(f"{base}/generate", json={"text": "hi"}, timeout=10)
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
    # one ingress replica: HTTP goes straight into it, Serve's proxy idles on another port
    assert f"ingress: direct on port {port} (Serve's proxy idles on" in text, text
    assert f"radixray is ready: {base}  (model \"tiny\", direct ingress)" in text, text


JOB_SCRIPT = """
import json, sys, httpx, ray
from ray import serve
import radixray
model, port = sys.argv[1], int(sys.argv[2])
ray.init(address="auto", namespace="radixray")
serve.start(http_options={"host": "127.0.0.1", "port": port})
app = radixray.build_app({"engine": {"model": model, "dtype": "float32", "max_total_tokens": 2048},
                          "server": {"port": port, "served_model_name": "tiny"}})
serve.run(app, name="radixray", route_prefix="/")
r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
               json={"model": "tiny", "prompt": "the cat", "max_tokens": 4, "temperature": 0})
print("JOB_RESULT", json.dumps(r.json()["usage"]))
serve.shutdown()
"""


@pytest.mark.slow  # ~1 min (a Ray head, its dashboard's job agent, a job): make test-slow
def test_ray_job_submit_builds_the_app_and_answers(tiny_llama_dir, tmp_path):
    gcs, dash, http = free_port(), free_port(), free_port()
    script = tmp_path / "job.py"
    script.write_text(JOB_SCRIPT)
    subprocess.run([RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
                    "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
                    "--dashboard-port", str(dash), "--num-cpus", "2", "--disable-usage-stats",
                    "--object-store-memory", str(256 * 1024 ** 2)],
                   env=ENV, check=True, capture_output=True, timeout=180)
    try:
        deadline = time.monotonic() + 420
        while True:  # `ray start` returns before the dashboard's job agent takes jobs
            out = subprocess.run([RAY, "job", "submit", "--address", f"http://127.0.0.1:{dash}",
                                  "--", sys.executable, str(script), tiny_llama_dir, str(http)],
                                 env=ENV, capture_output=True, text=True, timeout=600)
            if "No available agent" not in out.stderr or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        line = next(x for x in out.stdout.splitlines() if x.startswith("JOB_RESULT"))
        usage = json.loads(line.split(" ", 1)[1])
        assert usage["completion_tokens"] == 4 and usage["prompt_tokens"] > 0
    finally:
        subprocess.run([RAY, "stop", "--force"], env=ENV, capture_output=True, timeout=120)
