"""Request limits and backpressure (serve/limits.py, EngineWorker's queue bound), without
Ray: each refusal names the request field, the bound and the config field."""

from types import SimpleNamespace

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from radixray.actors.engine_worker import EngineWorker
from radixray.cluster.config import ServeConfig
from radixray.cluster.errors import WorkerQueueFull
from radixray.serve.api_error import ApiError, api_error_from
from radixray.serve.limits import BodySizeLimit, BodyTooLarge, RequestLimits
from radixray.serve.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest

LIMITS = RequestLimits.from_server(ServeConfig.parse({"server": {
    "max_n": 4, "max_stop_sequences": 2, "max_top_logprobs": 5}}).server)
CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("req, check, param, bound", [
    (ChatCompletionRequest(messages=CHAT, n=5), "chat", "n", "server.max_n"),
    (ChatCompletionRequest(messages=CHAT, stop=["a", "b", "c"]), "chat", "stop",
     "server.max_stop_sequences"),
    (ChatCompletionRequest(messages=CHAT, logprobs=True, top_logprobs=6), "chat", "top_logprobs",
     "server.max_top_logprobs"),
    (CompletionRequest(prompt="x", logprobs=6), "completion", "logprobs",
     "server.max_top_logprobs"),
    (GenerateRequest(text="x", sampling_params={"n": 9}), "native", "sampling_params.n",
     "server.max_n"),
    (GenerateRequest(text="x", sampling_params={"stop": ["a", "b", "c"]}), "native",
     "sampling_params.stop", "server.max_stop_sequences"),
    (GenerateRequest(text="x", top_logprobs_num=6), "native", "top_logprobs_num",
     "server.max_top_logprobs"),
])
def test_each_limit_is_a_400_naming_the_field_and_the_bound(req, check, param, bound):
    with pytest.raises(ApiError) as err:
        if check == "native":
            LIMITS.check_native(req)
        else:
            LIMITS.check_openai(req, "logprobs" if check == "completion" else "top_logprobs")
    assert err.value.status == 400 and err.value.param == param
    assert err.value.message.startswith(f"{param} is ") and bound in err.value.message


def test_requests_at_the_bounds_pass():
    LIMITS.check_openai(ChatCompletionRequest(messages=CHAT, n=4, stop=["a", "b"],
                                              logprobs=True, top_logprobs=5), "top_logprobs")
    LIMITS.check_openai(CompletionRequest(prompt="x", stop="one"), "logprobs")
    LIMITS.check_native(GenerateRequest(text="x", sampling_params={"n": 4, "stop": "s"},
                                        top_logprobs_num=5))


@pytest.fixture
def echo():
    app = FastAPI()
    app.add_middleware(BodySizeLimit, max_bytes=1024)

    @app.exception_handler(BodyTooLarge)
    async def too_large(request: Request, exc: BodyTooLarge):
        return JSONResponse(exc.body(), status_code=413)

    @app.post("/echo")
    async def _(request: Request):
        return {"bytes": len(await request.body())}
    return TestClient(app)


def test_a_body_over_the_limit_is_a_413_from_its_length_or_while_it_streams(echo):
    assert echo.post("/echo", content=b"x" * 1024).json() == {"bytes": 1024}
    big = echo.post("/echo", content=b"x" * 1025)
    assert big.status_code == 413
    assert "server.max_request_body_bytes" in big.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(5):
            yield b"y" * 300
    streamed = echo.post("/echo", content=chunks())
    assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "request_too_large"


def _worker_with_queue(waiting: int, inbox: int, limit: int | None):
    """A worker whose engine has ``waiting`` queued and ``inbox`` not yet taken in."""
    return SimpleNamespace(max_queued_requests=limit, retry_after_s=3, worker_id="worker-0",
                           engine=SimpleNamespace(num_queued=lambda: waiting + inbox))


def test_a_full_queue_refuses_at_once_with_retry_after():
    EngineWorker._check_queue(_worker_with_queue(6, 1, 8), 1)  # 8 of 8: still taken
    with pytest.raises(WorkerQueueFull) as full:
        EngineWorker._check_queue(_worker_with_queue(6, 2, 8), 1)
    assert "server.max_queued_requests=8" in str(full.value)
    EngineWorker._check_queue(_worker_with_queue(10_000, 0, None), 1)  # no bound
    err = api_error_from(full.value)
    assert (err.status, err.code, err.headers) == (503, "queue_full", {"Retry-After": "3"})
    import pickle  # it crosses Ray as a pickle: the retry hint must survive
    assert pickle.loads(pickle.dumps(full.value)).retry_after_s == 3
