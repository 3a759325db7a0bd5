"""Start radixray serving apps for tests: a local Ray on loopback, Serve on a free port."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from radixray.bench.launch import free_port  # noqa: F401 - the tests' port picker

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false"}


def tiny_config(model_dir: str, port: int, **server) -> dict:
    return {"engine": {"model": model_dir, "dtype": "float32", "max_total_tokens": 4096,
                       "check_kv_conservation": True},
            "server": {"port": port, "served_model_name": "tiny", **server}}


def start_radixray_serve(model_dir: str, port: int, log, *flags: str, env: dict | None = None,
                         max_total_tokens: int = 4096):
    """`radixray serve` of a tiny fp32 model (served name "tiny") as users run it, in a
    process group of its own; output to the open file ``log``. Returns the Popen."""
    import subprocess
    import sys
    return subprocess.Popen(
        [sys.executable, "-m", "radixray.cli", "serve", "--model", model_dir, "--port",
         str(port), "--dtype", "float32", "--max-total-tokens", str(max_total_tokens),
         "--num-cpus", "2", "--served-model-name", "tiny", *flags], stdout=log,
        stderr=subprocess.STDOUT, env={**os.environ, **RAY_ENV, **(env or {})},
        start_new_session=True)


def start_local_ray():
    import ray
    os.environ.update(RAY_ENV)
    ray.init(_node_ip_address="127.0.0.1", num_cpus=2, object_store_memory=256 * 1024 ** 2,
             include_dashboard=False, namespace="radixray", log_to_driver=False)


def serve_app(config: dict, proxy_location: str | None = None) -> str:
    """Deploy ``build_app(config)``; return the base URL once /ready answers 200.
    ``proxy_location`` goes to ``serve.start`` (Ray Serve's default, one HTTP proxy per
    node, when None)."""
    from ray import serve

    from radixray import build_app
    from radixray.serve.builder import resolve_config
    from radixray.serve.fleet import prestart_fleet
    port = config["server"]["port"]
    options = {} if proxy_location is None else {"proxy_location": proxy_location}
    cfg = resolve_config(config)
    fleet_beats = prestart_fleet(cfg, f"test-{os.getpid()}")  # as the CLI does
    serve.start(http_options={"host": "127.0.0.1", "port": port}, **options)
    serve.run(build_app(cfg), name="radixray", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base)
    fleet_beats.set()
    return base


@contextmanager
def served(config: dict) -> Iterator[str]:
    """A local Ray serving ``build_app(config)``: yields the base URL once /ready is 200,
    and shuts Serve and Ray down afterwards."""
    import ray
    from ray import serve
    start_local_ray()
    try:
        yield serve_app(config)
    finally:
        serve.shutdown()
        ray.shutdown()


def wait_ready(base: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/ready", timeout=120).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base}/ready did not answer 200 within {timeout} s")


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        m = re.match(r"^[^{ ]+(?:\{(.*)\})? (\S+)$", line)
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def assert_disconnect_returns_kv(base: str, headers: dict | None = None) -> None:
    """A streaming client that goes away mid-stream aborts its request, and every KV slot
    of worker-0 is free or cached afterwards (the endpoint also asserts conservation).
    ``headers``: sent with every request (a key that opens the API and control routes).

    Two outcomes run the scenario again rather than fail, as neither says anything about
    radixray's abort path:
    - the request finished before the pause that holds it in place reached its worker (a
      tiny model on a fast host writes its 1,000 tokens in under a second);
    - the ingress never ended the request (its HTTP latency histogram never counted it):
      Ray Serve did not cancel it on the replica (ray-project/ray#52533, a cancellation
      lost between the proxy and the replica leaves the handler running).
    A request the ingress ended but the worker kept is ours, and fails at once. The fleet
    is resumed after every attempt, whatever its outcome."""
    outcomes = []
    for _ in range(DISCONNECT_ATTEMPTS):
        outcome = _disconnect_once(base, headers)
        if outcome is None:
            return
        outcomes.append(outcome)
    raise AssertionError(f"no attempt of {DISCONNECT_ATTEMPTS} got a disconnect to the "
                         f"worker: {outcomes}")


DISCONNECT_ATTEMPTS = 5
STREAMS_ENDED = "radixray:http_request_duration_seconds_count"


def _disconnect_once(base: str, headers: dict | None) -> str | None:
    """One disconnect: None when the abort was checked, else why the attempt says nothing
    (see the caller)."""
    before = httpx.get(f"{base}/metrics", headers=headers, timeout=60).text
    held = None
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json={
                "prompt": "the cat", "max_tokens": 1000, "ignore_eos": True, "stream": True},
                headers=headers, timeout=60) as s:
            lines = s.iter_lines()
            got = [next(lines) for _ in range(4)]
            # Hold the request in place so it cannot finish before the disconnect reaches
            # its worker (a tiny model writes its tokens faster than the proxy notices a
            # close).
            paused = httpx.post(f"{base}/pause_generation", json={"mode": "in_place"},
                                headers=headers, timeout=60)
            held = paused.json()["requests"]
        assert any(line.startswith("data: ") for line in got)
        if held != {"worker-0": 1}:
            return f"the request had finished before the pause held it ({paused.text})"
        if not _wait_idle(base, headers, before):
            return "Ray Serve never cancelled the disconnected request on the replica"
        _check_abort_counted(base, before, headers)
        return None
    finally:
        httpx.post(f"{base}/continue_generation", headers=headers, timeout=60).raise_for_status()
        _wait_idle(base, headers, None)  # a request Ray kept alive runs to its end


def _wait_idle(base: str, headers: dict | None, before: str | None) -> bool:
    """Wait until worker-0 runs and queues nothing, KV conserved (True). With ``before``
    (the metrics before the request): False once the ingress has had 20 s to end the
    request and has not; a request the ingress ended must be gone within 90 s."""
    start = time.monotonic()
    kv = None
    while time.monotonic() - start < 90:  # generous: a loaded host is slow to notice
        kv = httpx.get(f"{base}/debug/kv_conservation", headers=headers,
                       timeout=60).json()["worker-0"]
        if kv["running"] == 0 and kv["waiting"] == 0:
            assert kv["free"] + kv["cached"] == kv["pool"]
            return True
        if before is not None and time.monotonic() - start > 20:
            after = httpx.get(f"{base}/metrics", headers=headers, timeout=60).text
            route = {"route": "/v1/completions"}
            if metric(after, STREAMS_ENDED, **route) <= metric(before, STREAMS_ENDED, **route):
                return False
        time.sleep(0.1)
    raise AssertionError(f"worker-0 still runs a request 90 s after its client left: {kv}")


def _check_abort_counted(base: str, before: str, headers: dict | None) -> None:
    aborted = 0.0
    for _ in range(100):  # /metrics reads the workers' counters as last collected
        after = httpx.get(f"{base}/metrics", headers=headers, timeout=60).text
        aborted = metric(after, "radixray:num_aborted_reqs_total") - metric(
            before, "radixray:num_aborted_reqs_total")
        if aborted >= 1:
            break
        time.sleep(0.1)
    assert aborted == 1, f"{aborted} requests counted as aborted"


@contextmanager
def uvicorn_in_thread(app, timeout: float = 30) -> Iterator[str]:
    """Serve the ASGI ``app`` with uvicorn in a daemon thread on a free loopback port; yield
    its base URL once it listens, and stop it afterwards."""
    import threading

    import uvicorn
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


@contextmanager
def local_ray(num_cpus: int = 2):
    """A local Ray on loopback with a small object store (the RL jobs' tests); yields the GCS
    address, as RAY_ADDRESS takes it."""
    import ray
    os.environ.update(RAY_ENV)
    ray.init(_node_ip_address="127.0.0.1", num_cpus=num_cpus,
             object_store_memory=256 * 1024 ** 2, include_dashboard=False,
             namespace="radixray", log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
