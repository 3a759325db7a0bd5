"""An autoscaled prefill-decode fleet on a local Ray (tiny Llama; 1 prefill + 1 decode
worker, each role 1..2): a prefill-heavy burst (long prompts, two output tokens) breaks
the TTFT target and fills the prefill queue, so a prefill worker is added and no decode
worker; the new prefill worker takes requests through the prefill-decode path, and no
request gets a 5xx. Waits are on conditions, with generous deadlines. The TTFT target
(1 ms) is below what a 400-token prefill takes on any CPU, so the burst breaks it however
fast the machine; TPOT's (5 s) is beyond reach, so decode has no cause to grow."""

import threading
import time

import httpx
import pytest
from serving_helpers import free_port, metric, served, tiny_config

pytestmark = pytest.mark.slow

DEADLINE_S = 180.0


def test_a_prefill_heavy_burst_adds_a_prefill_worker_only(tiny_llama_dir):
    cfg = tiny_config(tiny_llama_dir, free_port(), worker_num_cpus=0.5, slo_ttft_s=0.001,
                      slo_tpot_s=5.0)
    cfg["fleet"] = {"prefill_workers": 1, "decode_workers": 1, "health_check_interval_s": 0.5,
                    "autoscaling": {"upscale_delay_s": 0, "downscale_delay_s": 3600,
                                    "look_back_period_s": 2, "decision_interval_s": 0.5,
                                    "prefill": {"min_workers": 1, "max_workers": 2},
                                    "decode": {"min_workers": 1, "max_workers": 2}}}
    with served(cfg) as base:
        stop, statuses = threading.Event(), []
        words = " ".join(f"w{i}" for i in range(100))  # ~400 tokens of 1,024

        def client(i: int) -> None:
            with httpx.Client(timeout=120) as c:
                n = 0
                while not stop.is_set():
                    n += 1
                    statuses.append(c.post(f"{base}/v1/completions", json={
                        "model": "tiny", "prompt": f"{i} {n} {words}", "max_tokens": 2,
                        "ignore_eos": True}).status_code)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
        for t in threads:
            t.start()

        def fleet() -> dict:
            return httpx.get(f"{base}/fleet", timeout=60).json()
        try:
            deadline, state = time.monotonic() + DEADLINE_S, fleet()
            while not any(w["role"] == "prefill" and w["worker_id"] == "worker-2"
                          and w["state"] == "ready" for w in state["workers"]):
                assert time.monotonic() < deadline, f"no second prefill worker: {state}"
                time.sleep(0.5)
                state = fleet()
            served_before = metric(httpx.get(f"{base}/metrics", timeout=60).text,
                                   "radixray:router_requests_total", worker="worker-2")
            deadline = time.monotonic() + DEADLINE_S
            while metric(httpx.get(f"{base}/metrics", timeout=60).text,
                         "radixray:router_requests_total", worker="worker-2") <= served_before:
                assert time.monotonic() < deadline, "the new prefill worker takes no requests"
                time.sleep(0.5)
        finally:
            stop.set()
            for t in threads:
                t.join(180)
        assert statuses and all(s == 200 for s in statuses), sorted(set(statuses))
        state = fleet()
        roles = sorted((w["role"], w["state"]) for w in state["workers"])
        assert roles == [("decode", "ready"), ("prefill", "ready"), ("prefill", "ready")]
        decisions = state["autoscaling"]["decisions"]
        up = [d for d in decisions if d["direction"] == "up"]
        assert up and all(d["role"] == "prefill" for d in up), decisions
        assert "ttft_s" in up[0]["inputs"] or "queue_length" in up[0]["inputs"]
        page = httpx.get(f"{base}/metrics", timeout=60).text
        assert metric(page, "radixray:autoscaling_decisions_total", role="prefill",
                      direction="up") >= 1
        assert metric(page, "radixray:autoscaling_decisions_total", role="decode",
                      direction="up") == 0
        assert metric(page, "radixray:autoscaling_current_workers", role="decode") == 1
        assert state["disaggregation"]["ready"] is True
