"""A real Prometheus (Debian's ``prometheus`` package) scraping a test server, and PromQL
evaluated through its HTTP API."""

from __future__ import annotations

import contextlib
import json
import pathlib
import shutil
import subprocess
import time

import httpx
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]


def dashboard_expressions() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of deploy/grafana/radixray.json."""
    board = json.loads((ROOT / "deploy" / "grafana" / "radixray.json").read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p["targets"]]


@contextlib.contextmanager
def prometheus_scraping(target: str, port: int, workdir: pathlib.Path, interval: str = "1s"):
    """Prometheus with deploy/prometheus/prometheus.yml, its radixray job pointed at
    ``target`` (host:port) every ``interval``; yields its base URL once ready."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("needs the prometheus binary: apt-get install prometheus (Debian's package; "
                    "the Makefile's set-up installs it)")
    cfg = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = cfg["global"]["evaluation_interval"] = interval
    cfg["scrape_configs"] = [dict(c, static_configs=[{"targets": [target]}])
                             for c in cfg["scrape_configs"] if c["job_name"] == "radixray"]
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen(
        [binary, f"--config.file={workdir / 'prometheus.yml'}",
         f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=open(workdir / "prometheus.log", "w"))
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{base}/-/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (workdir / "prometheus.log").read_text()[-2000:]
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


def query(base: str, expr: str) -> list:
    r = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=30)
    body = r.json()
    assert body.get("status") == "success", f"{expr}: {body}"
    return body["data"]["result"]


def wait_scraped(base: str, series: str, samples: int, timeout: float = 60) -> None:
    """Until ``series`` has at least ``samples`` scraped points (rate() needs two)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = query(base, f"count_over_time({series}[5m])")
        if got and max(float(r["value"][1]) for r in got) >= samples:
            return
        time.sleep(0.5)
    raise AssertionError(f"Prometheus did not scrape {series} {samples} times in {timeout} s")
