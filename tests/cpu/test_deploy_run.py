"""The deploy commands of docs/deploy.md, run for real against one local Ray head (loopback,
with its dashboard): `serve deploy` and `serve run` of configs/serve/serve_app.yaml, and
`ray job submit` of a serving job (`serve run` of the same file) and of a 1-step GRPO run.

The deploy file is used as shipped except for its HTTP port (a free one) and
``fleet.owner_timeout_s`` (8 s instead of 30, so that the fleet of a deleted app is seen
to stop without a half-minute wait). The GRPO job runs a tiny-model config of the shipped
one's shape; the shipped SmolLM2 config takes minutes per step on these machines. The
tests run in file order and share one head: each leaves it without an app.
"""

import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest
import yaml
from serving_helpers import RAY_ENV, free_port, wait_ready

BIN = os.path.dirname(sys.executable)
# as docs/deploy.md has it: Ray started from the venv, so a job's `python` is the venv's
ENV = {**os.environ, **RAY_ENV, "PATH": BIN + os.pathsep + os.environ.get("PATH", "")}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OWNER_TIMEOUT_S = 8.0


def _cli(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([os.path.join(BIN, args[0]), *args[1:]], env=ENV, cwd=REPO,
                         capture_output=True, text=True, timeout=timeout)
    if check:
        assert out.returncode == 0, f"{args}: {out.stdout[-3000:]}{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def head():
    """A Ray head with its dashboard (the job and Serve REST APIs): (gcs, dashboard URL).
    Every port is a free one: a default port still held by a Ray that another test module
    just stopped would leave the job agent without its HTTP server."""
    gcs, dash = free_port(), free_port()
    ports = {flag: str(free_port()) for flag in (
        "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
        "--metrics-export-port", "--ray-client-server-port")}
    _cli("ray", "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
         "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--dashboard-port",
         str(dash), "--num-cpus", "4", "--disable-usage-stats",
         "--object-store-memory", str(256 * 1024 ** 2), *(x for kv in ports.items() for x in kv),
         timeout=180)
    try:
        yield f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dash}"
    finally:
        _cli("ray", "stop", "--force", timeout=120, check=False)


@pytest.fixture(scope="module")
def deploy_file(tmp_path_factory) -> tuple[str, str]:
    """configs/serve/serve_app.yaml on a free port: (its path, the app's base URL)."""
    port = free_port()
    with open(os.path.join(REPO, "configs/serve/serve_app.yaml")) as f:
        data = yaml.safe_load(f)
    data["http_options"]["port"] = port
    data["applications"][0]["args"].setdefault("fleet", {})["owner_timeout_s"] = OWNER_TIMEOUT_S
    path = tmp_path_factory.mktemp("deploy") / "serve_app.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path), f"http://127.0.0.1:{port}"


def _chat(base: str) -> str:
    from openai import OpenAI
    wait_ready(base)
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "What is 2 + 2?"}],
        max_tokens=8, temperature=0)
    assert reply.usage.completion_tokens >= 1 and reply.choices[0].message.content
    return reply.choices[0].message.content


def _fleet_actors(dashboard: str) -> set[str]:
    from ray.util.state import list_actors
    alive = list_actors(address=dashboard, limit=1000, filters=[("state", "=", "ALIVE")])
    return {a.class_name for a in alive} & {"Controller", "EngineWorker", "RouterActor"}


def _submit(dashboard: str, *entrypoint: str, timeout: float = 600) -> str:
    """``ray job submit`` (waits for the job); returns its output once the job's status is
    SUCCEEDED. Retries while the dashboard's job agent is still starting."""
    job_id = f"radixray-test-{uuid.uuid4().hex[:8]}"
    deadline = time.monotonic() + 300
    while True:
        out = _cli("ray", "job", "submit", "--address", dashboard, "--submission-id", job_id,
                   "--working-dir", ".", "--", *entrypoint, timeout=timeout, check=False)
        if "No available agent" not in out.stderr or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    from ray.job_submission import JobStatus, JobSubmissionClient
    status = JobSubmissionClient(dashboard).get_job_status(job_id)
    assert status == JobStatus.SUCCEEDED, f"{status}\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
    return out.stdout


@pytest.mark.slow  # ~55 s with its Ray head: out of the quick run's 15-minute budget
def test_a_serving_job_then_serve_deploy_then_serve_run_until_ctrl_c(head, deploy_file):
    """One app through every command, in the order that starts its fleet once:
    - `ray job submit -- serve run --non-blocking FILE` (Ray's pattern for deploying Serve
      from a job): the job submits the config and SUCCEEDS; the app comes up and answers;
    - `serve deploy FILE` of the same config: accepted, the app RUNNING and answering;
    - `serve run FILE` in the foreground takes the app over (same config: the running
      replicas stay), answers, and Ctrl-C takes the app down;
    - the fleet's controller is detached (no ingress replica's death takes the fleet
      down), so it must notice its app is gone: without heartbeats it stops the workers."""
    gcs, dashboard = head
    path, base = deploy_file
    _submit(dashboard, "serve", "run", "--non-blocking", path)
    _chat(base)
    assert _fleet_actors(dashboard) == {"Controller", "EngineWorker", "RouterActor"}
    _cli("serve", "deploy", path, "--address", dashboard)
    _chat(base)
    status = _cli("serve", "status", "--address", dashboard).stdout
    assert "status: RUNNING" in status, status
    log = open(os.path.join(os.path.dirname(path), "serve_run.log"), "w")
    proc = subprocess.Popen([os.path.join(BIN, "serve"), "run", path, "--address", gcs],
                            env=ENV, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "Submitted deploy config successfully" not in open(log.name).read():
            assert proc.poll() is None, open(log.name).read()[-3000:]
            assert time.monotonic() < deadline, open(log.name).read()[-3000:]
            time.sleep(0.2)
        _chat(base)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, open(log.name).read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    with pytest.raises(httpx.HTTPError):  # Ctrl-C took the app down with it
        httpx.get(f"{base}/ready", timeout=5)
    deadline = time.monotonic() + OWNER_TIMEOUT_S + 60
    while _fleet_actors(dashboard):
        assert time.monotonic() < deadline, f"the fleet outlived its app: {_fleet_actors(dashboard)}"
        time.sleep(0.5)


@pytest.mark.slow  # out of the default run's 15-minute budget: make test-slow
def test_ray_job_submit_of_a_one_step_grpo_run(head, tiny_llama_dir, tmp_path):
    """The RayJob's entrypoint (k8s/rayjob-grpo.yaml) with --steps 1 on a tiny model."""
    import json
    _, dashboard = head
    with open(os.path.join(REPO, "configs/rl/grpo_smollm2.yaml")) as f:
        data = yaml.safe_load(f)
    data.update(model=tiny_llama_dir, prompts_per_step=2, group_size=2, max_new_tokens=8,
                held_out_prompts=2, micro_batch_size=4)
    data["fleet"]["engine"]["dtype"] = "float32"
    config = tmp_path / "grpo_tiny.yaml"
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    _submit(dashboard, "python", "-m", "radixray.rl.grpo", "--config", str(config), "--steps",
            "1", "--output-dir", str(tmp_path / "out"))
    rows = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0] and rows[0]["synced_version"] == 1
    assert (tmp_path / "out" / "summary.json").exists()
