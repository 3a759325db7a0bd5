"""Prefill-decode disaggregation through the served app (`radixray serve --prefill-workers 1
--decode-workers 1` on the default model): output equal to a unified engine's, streaming
and not, n > 1, logprobs; prefix hits; readiness and metrics; a prefill or decode worker
killed mid-transfer fails the request cleanly and leaks no slot on the survivor."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from serving_helpers import free_port, metric, served, wait_ready

from radixray.engine.faults import FaultInjector, StallKVSend

PORT = free_port()
CONFIG = {"engine": {"model": "default", "max_total_tokens": 6144,
                     "check_kv_conservation": True},
          "fleet": {"prefill_workers": 1, "decode_workers": 1,
                    "prefill_engine": {"chunked_prefill_size": 128}},
          "server": {"port": PORT, "served_model_name": "smol"}}
PROMPTS = ["The capital city of France is", "List three colors:",
           "def fibonacci(n):\n    "]


@pytest.fixture(scope="module")
def server():
    with served(CONFIG) as base:
        yield base


@pytest.fixture(scope="module")
def engine():
    from radixray import Engine
    with Engine(model="default") as e:
        yield e


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def _handle(worker: str):
    import ray

    from radixray.cluster.config import ServeConfig
    from radixray.serve.fleet import find_controller
    controller = find_controller(ServeConfig.parse(CONFIG))
    return ray.get(controller.worker.remote(worker)).handle


def _handles() -> tuple:
    """(prefill worker, decode worker) actor handles."""
    return _handle("worker-0"), _handle("worker-1")


def _kv_clean(base: str, worker: str) -> dict:
    """Wait until ``worker`` holds no request and no room; its slot check must hold."""
    import ray
    handle = _handle(worker)
    for _ in range(200):
        kv = httpx.get(f"{base}/debug/kv_conservation", timeout=60).json()[worker]
        rooms = ray.get(handle.pd_status.remote())["rooms"]
        if kv.get("running") == 0 and kv.get("waiting") == 0 and rooms == 0:
            break
        time.sleep(0.1)
    assert kv["free"] + kv["cached"] == kv["pool"], kv
    assert rooms == 0
    return kv


def test_ready_fleet_shows_roles_and_handshake(server):
    assert httpx.get(f"{server}/ready", timeout=60).status_code == 200
    fleet = httpx.get(f"{server}/fleet").json()
    assert [w["role"] for w in fleet["workers"]] == ["prefill", "decode"]
    pd = fleet["disaggregation"]
    assert pd["ready"] and pd["prefill"] == ["worker-0"] and pd["decode"] == ["worker-1"]
    assert pd["handshake"]["pair"] == ["worker-0", "worker-1"]
    assert set(pd["endpoints"]) == {"worker-0", "worker-1"}
    assert fleet["router"]["decode"]["policy"] == "least_load"


def test_greedy_equals_unified_engine(client, engine):
    for prompt in PROMPTS:
        want = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0,
                                        "return_logprob": True})
        got = client.completions.create(model="smol", prompt=prompt, max_tokens=16,
                                        temperature=0, n=2, logprobs=2)
        assert [c.text for c in got.choices] == [want["text"]] * 2
        assert got.choices[0].logprobs.token_logprobs == pytest.approx(
            want["output_token_logprobs"], abs=1e-4)
        stream = client.completions.create(model="smol", prompt=prompt, max_tokens=16,
                                           temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want["text"]
    chat = [{"role": "user", "content": "Name a fruit."}]
    ids = engine.apply_chat_template(chat)
    want = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 12,
                                                           "temperature": 0})
    got = client.chat.completions.create(model="smol", messages=chat, max_tokens=12,
                                         temperature=0)
    assert got.choices[0].message.content == want["text"]


def test_shared_prefix_hits_prefill_cache_and_moves_less(server, client, engine):
    prefix = "Once upon a time there was a tiny robot who loved to read. " * 12
    before = httpx.get(f"{server}/metrics").text
    first = client.completions.create(model="smol", prompt=prefix + "It read", max_tokens=4,
                                      temperature=0)
    mid = httpx.get(f"{server}/metrics").text
    second = client.completions.create(model="smol", prompt=prefix + "Then it", max_tokens=4,
                                       temperature=0)
    after = httpx.get(f"{server}/metrics").text
    n_prefix = len(engine.tokenizer.encode(prefix))
    assert second.usage.prompt_tokens_details.cached_tokens >= n_prefix - 2
    sent = [metric(b, "radixray:kv_transfer_bytes_total") - metric(a, "radixray:kv_transfer_bytes_total")
            for a, b in ((before, mid), (mid, after))]
    assert 0 < sent[1] < sent[0] / 5  # the decode worker cached the prefix too
    want = engine.generate(prefix + "Then it", {"max_new_tokens": 4, "temperature": 0})
    assert second.choices[0].text == want["text"]
    assert first.choices[0].text


def test_direct_request_to_a_decode_worker_is_refused(server):
    import ray

    from radixray.cluster.messages import SubmitRequest
    from radixray.engine.sampling import SamplingParams
    _, decode = _handles()
    ray.get(decode.stream.options(num_returns="streaming").remote("direct-test").__next__())
    with pytest.raises(Exception, match="send them to the serving endpoint"):
        ray.get(decode.submit.remote("direct-test", [SubmitRequest(
            "direct-1", [1, 2, 3], SamplingParams(max_new_tokens=2))]))


def test_prometheus_evaluates_every_dashboard_expression(server, tmp_path):
    """deploy/prometheus/prometheus.yml scraping this fleet (prefill-decode, so the transfer
    panels have data too); every PromQL expression of deploy/grafana/radixray.json returns
    data through Prometheus' HTTP API after some traffic. Runs before the kill tests: it
    needs both workers up."""
    from prometheus_helpers import dashboard_expressions, prometheus_scraping, query, wait_scraped
    with prometheus_scraping(f"127.0.0.1:{PORT}", free_port(), tmp_path) as prom:
        wait_scraped(prom, "radixray:generation_tokens_total", 2)
        for i in range(3):
            r = httpx.post(f"{server}/v1/completions", json={
                "model": "smol", "prompt": f"Count to {i + 3}:", "max_tokens": 6}, timeout=120)
            assert r.status_code == 200
        wait_scraped(prom, "radixray:generation_tokens_total", 4)
        time.sleep(2.5)  # two more scrapes after the traffic: rates see it
        empty = [(title, expr) for title, expr in dashboard_expressions()
                 if not query(prom, expr)]
    assert not empty, f"dashboard expressions without data: {empty}"


def _long_request(base: str, out: dict) -> None:
    words = " ".join(f"word{i}" for i in range(300))
    try:
        r = httpx.post(f"{base}/v1/completions", json={
            "model": "smol", "prompt": words, "max_tokens": 8, "temperature": 0}, timeout=120)
        out["status"], out["body"] = r.status_code, r.json()
    except Exception as exc:  # noqa: BLE001 - recorded for the assertion
        out["error"] = exc


def _kill_mid_transfer(base: str, victim: str) -> dict:
    """Stall the prefill sender before a room's last write (its first chunks written),
    kill ``victim``, return the client's answer."""
    import ray
    prefill, decode = _handles()
    ray.get(prefill.attach_fault_injector.remote(
        FaultInjector(StallKVSend(3.0 if victim == "decode" else 60.0))))
    out: dict = {}
    t = threading.Thread(target=_long_request, args=(base, out))
    t.start()
    deadline = time.monotonic() + 60
    while not ray.get(prefill.pd_status.remote())["stalled"]:
        assert time.monotonic() < deadline, "the prefill sender never stalled"
        time.sleep(0.02)
    assert ray.get(decode.pd_status.remote())["transfer"] == 1  # slots reserved, KV awaited
    ray.kill(decode if victim == "decode" else prefill, no_restart=True)
    t.join(120)
    return out


@pytest.mark.slow  # out of the default run's 15-minute budget: make test-slow
def test_prefill_killed_mid_transfer(server):
    out = _kill_mid_transfer(server, "prefill")
    assert out["status"] == 503, out
    assert "prefill-decode pair failed" in out["body"]["error"]["message"]
    _kv_clean(server, "worker-1")  # the decode worker freed the reserved slots
    wait_ready(server)  # the controller restarted the prefill worker; handshake again
    r = httpx.post(f"{server}/v1/completions", json={"model": "smol", "prompt": "Hi",
                                                     "max_tokens": 3}, timeout=120)
    assert r.status_code == 200


def test_decode_killed_mid_transfer(server):
    out = _kill_mid_transfer(server, "decode")
    assert out["status"] == 503, out
    _kv_clean(server, "worker-0")  # the prefill worker's sender failed and let go
    import ray
    load = ray.get(_handle("worker-0").load.remote())
    assert load.pd["transfer_failed"] >= 1  # counted on the side that saw the write fail
    # (the restart and a request after it are checked in the prefill-kill test)


def test_radixray_drain_drains_every_fleet(server):
    """The preStop hook of k8s/rayservice.yaml: the fleet refuses new requests afterwards
    (this module's last test: the fleet stays drained)."""
    import argparse

    from radixray.serve.drain_cli import cmd_drain
    assert cmd_drain(argparse.Namespace(address="auto", timeout=60)) == 0
    r = httpx.get(f"{server}/ready", timeout=60)
    assert r.status_code == 503 and r.json()["status"] == "draining"
