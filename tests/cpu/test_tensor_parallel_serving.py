"""A tensor-parallel worker served on one node: ``engine.tp_size: 2`` makes the worker actor
the driver rank and its follower a rank actor in a placement bundle of its own (two bundles
of one CPU). The official openai client gets TP 1's greedy tokens; a killed follower makes
the worker report its engine failed, and the controller restarts the worker with a new
follower (the group restarts as a unit); serving resumes and no KV slot is lost."""

from __future__ import annotations

import time

import httpx
import psutil
import pytest
from serving_helpers import free_port, served, tiny_config

from radixray import Engine

pytestmark = pytest.mark.slow
PROMPTS = ["the tensor parallel test", "one more prompt", "and a third one to batch"]
RESTART_DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def config(tiny_llama_dir):
    cfg = tiny_config(tiny_llama_dir, free_port())
    cfg["engine"].update(tp_size=2, tp_timeout_s=30, max_consecutive_failed_steps=2)
    cfg["fleet"] = {"workers": 1, "health_check_interval_s": 0.5, "max_restarts": 2}
    cfg["router"] = {"retry_backoff_s": 0.05}
    return cfg


@pytest.fixture(scope="module")
def server(config):
    with served(config) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def _greedy(client) -> list[str]:
    out = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def _record(base: str) -> dict:
    return httpx.get(f"{base}/fleet", timeout=60).json()["workers"][0]


def _followers(rec: dict) -> list[psutil.Process]:
    """The worker's follower rank actors' processes (all on this machine's one node)."""
    assert [r["rank"] for r in rec["tp_ranks"]] == [0, 1] and rec["tp_ranks"][0]["pid"] == \
        rec["pid"]
    return [psutil.Process(r["pid"]) for r in rec["tp_ranks"][1:]]


def test_served_tp2_gives_tp1_tokens(client, tiny_llama_dir):
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096) as eng:
        want = [eng.generate(p, {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
                ["text"] for p in PROMPTS]
    assert _greedy(client) == want


def test_a_killed_follower_restarts_the_worker_as_a_unit(server, client):
    before = _record(server)
    (follower,) = _followers(before)
    follower.kill()  # SIGKILL
    deadline = time.monotonic() + RESTART_DEADLINE_S
    texts = None
    while texts is None:  # requests fail until the controller replaced the worker
        assert time.monotonic() < deadline, _record(server)
        try:
            texts = _greedy(client)
        except Exception:  # noqa: BLE001 - 500/503 while the group is down
            time.sleep(0.5)
    rec = _record(server)
    assert rec["generation"] == before["generation"] + 1 and rec["state"] == "ready"
    assert rec["node_ip"] == before["node_ip"] == "127.0.0.1"  # the Ray node it runs on
    (new,) = _followers(rec)
    assert new.pid != follower.pid and new.is_running()
    assert len(texts) == len(PROMPTS)
    kv = httpx.get(f"{server}/debug/kv_conservation", timeout=60).json()["worker-0"]
    assert kv["running"] == 0 and kv["waiting"] == 0 and kv["free"] + kv["cached"] == kv["pool"]
