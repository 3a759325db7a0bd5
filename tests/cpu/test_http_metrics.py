"""The ingress' HTTP latency series (serve/http_metrics.py) on a small FastAPI app, and
goodput against the SLO targets (cluster/metrics.py WorkerMetrics), without Ray."""

import asyncio

import pytest
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient
from serving_helpers import metric

from radixray.cluster.metrics import WorkerMetrics
from radixray.engine.messages import MetaInfo, RequestUpdate
from radixray.engine.request import FinishReason
from radixray.serve.http_metrics import HttpMetrics, HttpMetricsMiddleware

SERIES = "radixray:http_request_duration_seconds_count"


def _text(registry) -> str:
    from prometheus_client import generate_latest
    return generate_latest(registry).decode()


@pytest.fixture
def timed():
    metrics = HttpMetrics("ingress-test")
    app = FastAPI()
    app.add_middleware(HttpMetricsMiddleware, metrics=metrics)

    @app.get("/items/{item_id}")
    async def item(item_id: int):
        if item_id < 0:
            raise HTTPException(400, "item_id must be >= 0")
        return {"id": item_id}

    @app.get("/stream")
    async def stream():
        async def chunks():
            for i in range(3):
                await asyncio.sleep(0.05)
                yield f"data: {i}\n\n"
        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.get("/boom")
    async def boom():
        raise RuntimeError("handler bug")
    return TestClient(app, raise_server_exceptions=False), metrics


def test_every_request_counts_by_route_template_method_and_status(timed):
    client, metrics = timed
    for i in range(3):
        assert client.get(f"/items/{i}").status_code == 200
    assert client.get("/items/-1").status_code == 400
    assert client.get("/items/abc").status_code == 422
    assert client.get("/no/such/path").status_code == 404
    assert client.post("/items/1").status_code == 405
    assert client.get("/boom").status_code == 500
    text = _text(metrics.registry)
    count = {"replica": "ingress-test"}
    assert metric(text, SERIES, route="/items/{item_id}", method="GET", status="200", **count) == 3
    assert metric(text, SERIES, route="/items/{item_id}", status="400") == 1
    assert metric(text, SERIES, route="/items/{item_id}", status="422") == 1
    assert metric(text, SERIES, route="/boom", status="500") == 1
    # no route matched: one "other" series, never the raw path
    assert metric(text, SERIES, route="other", status="404") == 1
    assert "/no/such/path" not in text and "/items/1" not in text
    assert metric(text, SERIES) == 8


def test_a_stream_counts_its_whole_life(timed):
    client, metrics = timed
    assert client.get("/stream").text.count("data:") == 3
    text = _text(metrics.registry)
    assert metric(text, SERIES, route="/stream", status="200") == 1
    # three 50 ms chunks: the time to the headers alone would sit in the 5 ms bucket
    assert metric(text, "radixray:http_request_duration_seconds_bucket", route="/stream",
                  le="0.1") == 0
    assert metric(text, "radixray:http_request_duration_seconds_sum", route="/stream") >= 0.15


def _finished(rid: str, reason: str, ttft: float, e2e: float, tokens: int) -> RequestUpdate:
    meta = MetaInfo(id=rid, finish_reason=FinishReason(reason), prompt_tokens=5,
                    completion_tokens=tokens, cached_tokens=0, queue_time=0.0,
                    first_token_latency=ttft, e2e_latency=e2e, num_retractions=0)
    return RequestUpdate(rid=rid, ids=[1], meta=meta)


def test_goodput_counts_requests_within_both_slos():
    m = WorkerMetrics("worker-0", slo_ttft_s=1.0, slo_tpot_s=0.05)
    m.observe([
        _finished("fast", "stop", ttft=0.5, e2e=0.5 + 9 * 0.04, tokens=10),
        _finished("one-token", "length", ttft=0.9, e2e=0.9, tokens=1),  # no TPOT: TTFT decides
        _finished("edge", "length", ttft=1.0, e2e=1.0 + 4 * 0.05, tokens=5),  # targets inclusive
        _finished("slow-first", "stop", ttft=1.5, e2e=1.6, tokens=3),
        _finished("slow-decode", "stop", ttft=0.1, e2e=0.1 + 9 * 0.08, tokens=10),
        _finished("aborted", "abort", ttft=0.1, e2e=0.2, tokens=3),
        _finished("failed", "error", ttft=0.1, e2e=0.2, tokens=3),
    ])
    text = _text(m.registry)
    assert metric(text, "radixray:goodput_requests_total", worker="worker-0") == 3
    assert metric(text, "radixray:requests_total") == 7
    assert metric(text, "radixray:slo_target_seconds", slo="ttft") == 1.0
    assert metric(text, "radixray:slo_target_seconds", slo="tpot") == 0.05


def test_slo_targets_are_config_fields_with_bounds():
    from radixray.cluster.config import ConfigError, ServeConfig
    cfg = ServeConfig.parse({"server": {"slo_ttft_s": 0.5, "slo_tpot_s": 0.02}})
    assert (cfg.server.slo_ttft_s, cfg.server.slo_tpot_s) == (0.5, 0.02)
    with pytest.raises(ConfigError, match="slo_tpot_s"):
        ServeConfig.parse({"server": {"slo_tpot_s": 0}})
