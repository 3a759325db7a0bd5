"""The ingress side of worker channels and routing, against stand-in actor handles (no Ray).

Covers what is hard to provoke on a real cluster: a health probe that times out
cancels its request on the worker; a worker that dies mid-request ends the
request with an error instead of hanging it; a request that fails before its
first token is retried on another worker (unless its own batch failed), and the
router hears every outcome; a router that is restarting is waited for. Every test runs
with the step messages over TCP (the stand-in worker listens as the real one does,
cluster/step_socket.py) and over a Ray-like streaming generator.
"""

import asyncio
import dataclasses

import pytest
from model_fixtures import byte_bpe_tokenizer

from radixray.cluster.errors import WorkerDraining
from radixray.cluster.messages import ChannelState, FleetHealth, WorkerEntry, WorkerInfo
from radixray.cluster.router_client import RouterClient
from radixray.cluster.routing import NoWorkerAvailable
from radixray.cluster.step_socket import StepSocketServer, write_messages
from radixray.engine.messages import MetaInfo, RequestUpdate
from radixray.serve.api_error import ApiError, api_error_from
from radixray.serve.dispatch import Dispatcher
from radixray.serve.frontend import Frontend

TRANSPORT = {"name": "tcp"}  # the step transport the Dispatchers of a test use


@pytest.fixture(autouse=True, params=["tcp", "ray"])
def transport(request):
    TRANSPORT["name"] = request.param
    yield request.param
    TRANSPORT["name"] = "tcp"


def _died_message(error: str) -> bool:
    """The error of a request whose worker died: Ray names the cause; over TCP the
    connection just ends."""
    return ("worker process died" if TRANSPORT["name"] == "ray" else "stream ended") in error


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)

    def options(self, **_):
        return self


class FakeWorker:
    """Speaks the EngineWorker channel protocol. ``on_submit`` decides what a submit does:
    "silent" (never answers), "die" (the process dies), "token_then_die", "finish",
    "draining" (refuses), "engine_failed" / "batch_fault" (the engine ends the request
    with an error update, status 503 / 500)."""

    def __init__(self, on_submit: str = "silent"):
        self.aborted: list[list[str]] = []
        self.submitted: list[dict] = []
        self.on_submit = on_submit
        self.outbox: asyncio.Queue | None = None
        self.stream = _Method(self._stream)
        self.open_socket_channel = _Method(self._open_socket)
        self.wait_until_failed = _Method(lambda: asyncio.Event().wait())  # never fails
        self.submit = _Method(self._submit)
        self.abort = _Method(lambda rids: self.aborted.append(list(rids)))
        self._server: StepSocketServer | None = None

    async def _ref(self, value):
        if isinstance(value, Exception):
            raise value
        return value

    async def _stream(self, channel_id):
        self.outbox = asyncio.Queue()
        yield self._ref(ChannelState("fake", draining=False))
        while True:
            yield self._ref(await self.outbox.get())

    async def _open_socket(self, channel_id):
        if self._server is None:
            self._server = StepSocketServer("127.0.0.1", self._serve)
        return await self._server.offer(channel_id)

    async def _serve(self, channel_id, reader, writer):
        await write_messages(self._messages(), reader, writer)

    async def _messages(self):
        """The TCP form of the channel: an exception in the outbox is the process dying
        (its connection closes)."""
        self.outbox = asyncio.Queue()
        yield ChannelState("fake", draining=False)
        while not isinstance(message := await self.outbox.get(), Exception):
            yield message

    async def _submit(self, channel_id, requests):
        if self.on_submit == "draining":
            raise WorkerDraining("draining")
        self.submitted.extend(requests)
        rids = [r.rid for r in requests]
        if self.on_submit == "token_then_die":
            self.outbox.put_nowait([RequestUpdate(rid, [7]) for rid in rids])
        if self.on_submit in ("die", "token_then_die"):
            self.outbox.put_nowait(RuntimeError("worker process died"))
        for mode, status in (("engine_failed", 503), ("batch_fault", 500)):
            if self.on_submit == mode:
                self.outbox.put_nowait([RequestUpdate(rid, [], meta=_meta(rid), error=f"{mode} here",
                                                      status=status) for rid in rids])
        if self.on_submit == "finish":
            self.outbox.put_nowait([RequestUpdate(rid, [7, 8], meta=_meta(rid)) for rid in rids])


def _meta(rid: str) -> MetaInfo:
    return MetaInfo(rid, None, 3, 2, 0, None, None, None, 0)


class FakeRouter:
    """Picks the first worker not excluded, in a fixed order; records releases."""

    def __init__(self, order: list[str]):
        self.order = order
        self.released: list[tuple[str, object]] = []
        self.picks: list[tuple[str, bool]] = []
        self.pick = _Method(self._pick)
        self.release = _Method(lambda w, ok: self.released.append((w, ok)))

    async def _pick(self, text, session_id, exclude, retry):
        for w in self.order:
            if w not in exclude:
                self.picks.append((w, retry))
                return w, "test"
        raise NoWorkerAvailable("all excluded")


class FakeController:
    def __init__(self, workers: dict[str, FakeWorker]):
        self.workers = workers
        self.worker = _Method(self._worker)
        self.live_workers = _Method(self._live)
        self.health = _Method(self._health)

    async def _worker(self, worker_id):
        return WorkerEntry(worker_id, self.workers[worker_id], 0, "ready")

    async def _live(self):
        return [await self._worker(w) for w in self.workers]

    async def _health(self):
        return FleetHealth(draining=False, routable=len(self.workers))


def _frontend(*workers: FakeWorker) -> tuple[Frontend, FakeRouter]:
    named = {f"w{i}": w for i, w in enumerate(workers)}
    router = FakeRouter(list(named))
    dispatcher = Dispatcher(FakeController(named), router, max_attempts=3, backoff_s=0.0,
                            step_transport=TRANSPORT["name"])
    info = WorkerInfo("w0", "fake", context_len=64, vocab_size=400, max_total_tokens=4096,
                      draining=False)
    return Frontend(byte_bpe_tokenizer(), info, "fake", dispatcher), router


def _run(fe: Frontend, max_new_tokens: int = 4, timeout: float = 5):
    async def main():
        await fe.dispatcher.start()
        choices, streams = await fe.start([[1, 2, 3]], [{"max_new_tokens": max_new_tokens}])
        await asyncio.wait_for(fe.run_to_end(choices, streams), timeout)
        return choices[0]
    return asyncio.run(main())


def test_timed_out_probe_aborts_its_request():
    worker = FakeWorker()  # never answers
    fe, router = _frontend(worker)
    with pytest.raises(asyncio.TimeoutError):
        _run(fe, max_new_tokens=1, timeout=0.2)
    assert worker.aborted == [[worker.submitted[0].rid]]
    assert fe.dispatcher.clients["w0"]._queues == {}  # nothing left waiting
    assert router.released == [("w0", None)]  # a client that went away is no worker failure


def test_worker_death_ends_requests_with_an_error():
    worker = FakeWorker("token_then_die")
    fe, router = _frontend(worker)
    choice = _run(fe)
    assert choice.finished and _died_message(choice.error)
    assert choice.output_ids == [7]  # a request that streamed tokens is not retried
    assert not fe.dispatcher.clients["w0"].alive
    assert router.released == [("w0", False)]


def test_death_before_the_first_token_is_retried_on_another_worker():
    dying, healthy = FakeWorker("die"), FakeWorker("finish")
    fe, router = _frontend(dying, healthy)
    choice = _run(fe)
    assert choice.error is None and choice.output_ids == [7, 8]
    assert choice.meta.worker_id == "w1"
    assert [r.rid for r in healthy.submitted] == [choice.rid]
    assert router.picks == [("w0", False), ("w1", True)]
    assert router.released == [("w0", False), ("w1", True)]


def test_draining_worker_refusal_is_retried_and_not_a_failure():
    fe, router = _frontend(FakeWorker("draining"), FakeWorker("finish"))
    choice = _run(fe)
    assert choice.meta.worker_id == "w1"
    assert router.released == [("w0", None), ("w1", True)]


def test_out_of_attempts_is_a_clean_503():
    fe, router = _frontend(FakeWorker("die"), FakeWorker("die"), FakeWorker("die"),
                           FakeWorker("finish"))
    choice = _run(fe)
    assert choice.error_status == 503 and "retrying failed" in choice.error
    assert [w for w, _ in router.picks] == ["w0", "w1", "w2"]  # max_attempts = 3
    with pytest.raises(ApiError) as err:
        asyncio.run(fe.complete([choice], []))
    assert err.value.status == 503


def test_no_worker_at_submit_is_a_503():
    fe, _ = _frontend(FakeWorker("draining"))

    async def main():
        await fe.dispatcher.start()
        await fe.start([[1, 2, 3]], [{"max_new_tokens": 2}])
    with pytest.raises(ApiError) as err:
        asyncio.run(main())
    assert err.value.status == 503 and err.value.code == "draining"


def test_a_failed_engine_before_the_first_token_is_retried_elsewhere():
    fe, router = _frontend(FakeWorker("engine_failed"), FakeWorker("finish"))
    choice = _run(fe)
    assert choice.error is None and choice.meta.worker_id == "w1"
    assert router.released == [("w0", False), ("w1", True)]


def test_a_batch_fault_is_a_500_and_not_retried():
    """The request may have caused its batch's fault: another worker would fail it too."""
    fe, router = _frontend(FakeWorker("batch_fault"), FakeWorker("finish"))
    choice = _run(fe)
    assert choice.error == "batch_fault here" and choice.error_status == 500
    assert [w for w, _ in router.picks] == ["w0"] and router.released == [("w0", False)]
    err = choice.api_error()
    assert err.status == 500 and err.body()["error"]["type"] == "server_error"


class RestartingRouter(FakeRouter):
    """A router actor that is down (restarting) for its first ``down`` picks."""

    def __init__(self, order: list[str], down: int, error=None):
        super().__init__(order)
        from ray.exceptions import ActorUnavailableError
        self.down = down
        self.error = error or ActorUnavailableError("The actor is restarting.", None)
        self.pick = _Method(self._maybe_down)

    async def _maybe_down(self, *args):
        if self.down:
            self.down -= 1
            raise self.error
        return await self._pick(*args)


def _with_router(router, *workers: FakeWorker) -> Frontend:
    named = {f"w{i}": w for i, w in enumerate(workers)}
    router.order = list(named)
    dispatcher = Dispatcher(FakeController(named), RouterClient(router, wait_s=5.0,
                                                                sleep=_no_sleep),
                            max_attempts=3, backoff_s=0.0, step_transport=TRANSPORT["name"])
    info = WorkerInfo("w0", "fake", context_len=64, vocab_size=400, max_total_tokens=4096,
                      draining=False)
    return Frontend(byte_bpe_tokenizer(), info, "fake", dispatcher)


async def _no_sleep(_seconds):
    await asyncio.sleep(0)


def test_a_restarting_router_is_waited_for_not_failed():
    router = RestartingRouter([], down=3)
    fe = _with_router(router, FakeWorker("finish"))
    choice = _run(fe)
    assert choice.error is None and choice.output_ids == [7, 8]
    assert fe.dispatcher.router.waits == 1 and router.picks == [("w0", False)]


def test_a_router_down_for_good_is_a_clean_503():
    from ray.exceptions import ActorDiedError
    router = RestartingRouter([], down=10**9, error=ActorDiedError())
    fe = _with_router(router, FakeWorker("finish"))
    fe.dispatcher.router.wait_s = 0.0
    with pytest.raises(ApiError) as err:
        _run(fe)
    assert err.value.status == 503 and "router is unreachable" in err.value.message


def test_an_unreachable_controller_is_a_503_naming_the_restart():
    from ray.exceptions import ActorUnavailableError
    err = api_error_from(ActorUnavailableError("The actor is restarting.", None))
    assert err.status == 503 and err.code == "fleet_restarting"
    assert err.headers["Retry-After"] == "2"


@pytest.mark.parametrize("how", ["closed", "dropped", "body closed"])
def test_streams_given_up_unread_abort_their_requests_and_release_the_router(how):
    """Closing an async generator before its first read runs none of its code: a client
    gone before the first read (or a pair whose other side refused) must still abort its
    requests on the worker and give the router its pick back, whether the streams are
    closed or just dropped."""
    import gc

    from radixray.serve.closing_stream import ClosingStream, discard_all
    from radixray.serve.dispatch import close_all

    worker = FakeWorker()  # never answers: the requests stay in flight
    fe, router = _frontend(worker)

    async def main():
        await fe.dispatcher.start()
        _, streams = await fe.start([[1, 2, 3], [4, 5]], [{"max_new_tokens": 4}] * 2)
        if how == "closed":
            await close_all(streams)
        elif how == "body closed":  # a response cancelled before its first chunk
            async def body():
                async for _ in streams[0]:
                    yield "chunk"
            await ClosingStream(body(), lambda: discard_all(streams)).aclose()
        else:
            del streams
            gc.collect()
    asyncio.run(main())
    rids = sorted(r.rid for r in worker.submitted)
    assert sorted(rid for call in worker.aborted for rid in call) == rids, how
    assert fe.dispatcher.clients["w0"]._queues == {}, how
    assert router.released == [("w0", None)], how  # one pick for both, given back once


def test_a_stream_read_from_cleans_up_through_its_own_generator():
    from radixray.serve.closing_stream import ClosingStream
    ran = []

    async def gen():
        try:
            yield 1
            yield 2
        finally:
            ran.append("finally")

    async def main():
        s = ClosingStream(gen(), lambda: ran.append("unread"))
        assert await s.__anext__() == 1
        await s.aclose()
        s.discard()  # a no-op once read
        assert [x async for x in ClosingStream(gen(), lambda: ran.append("unread"))] == [1, 2]
    asyncio.run(main())
    assert ran == ["finally", "finally"]


@pytest.mark.parametrize("n", [1, 2])
def test_closing_a_streamed_response_aborts_its_requests_before_close_returns(n):
    """A client that goes away mid-stream closes the response body; the requests behind it
    end on their worker within that close, not whenever the garbage collector and the event
    loop get to the generators between (a paused request would hold its KV until then)."""
    from radixray.serve.openai_serving import completion
    from radixray.serve.protocol import CompletionRequest

    worker = FakeWorker()  # answers only what the test puts in its outbox
    fe, router = _frontend(worker)

    async def main():
        await fe.dispatcher.start()
        body = await completion(fe, CompletionRequest(prompt=[1, 2, 3], max_tokens=8, n=n,
                                                      stream=True))
        worker.outbox.put_nowait([RequestUpdate(r.rid, [7]) for r in worker.submitted])
        assert (await body.__anext__()).startswith("data: ")
        await body.aclose()
        return sorted(rid for call in worker.aborted for rid in call)
    aborted = asyncio.run(main())
    assert aborted == sorted(r.rid for r in worker.submitted) and len(aborted) == n
    assert fe.dispatcher.clients["w0"]._queues == {}
    assert router.released == [("w0", None)]


def test_an_unreachable_step_socket_falls_back_to_the_ray_stream(transport, caplog):
    """A worker whose TCP endpoint cannot be reached (ports closed between nodes) still
    serves: the channel opens as a Ray stream, logged."""
    import socket

    from radixray.cluster.step_socket import SocketEndpoint
    if transport != "tcp":
        pytest.skip("the fallback is the TCP transport's")
    worker = FakeWorker("finish")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]

    async def unreachable(channel_id):
        return SocketEndpoint("127.0.0.1", closed, "x" * 32, channel_id)
    worker.open_socket_channel = _Method(unreachable)
    fe, router = _frontend(worker)
    with caplog.at_level("WARNING", logger="radixray.ingress"):
        choice = _run(fe)
    assert choice.error is None and choice.output_ids == [7, 8]
    assert fe.dispatcher.clients["w0"]._gen is not None  # read through Ray's generator
    assert "step messages over Ray instead of TCP" in caplog.text


def test_a_step_socket_that_refuses_the_channel_is_an_unavailable_worker(transport):
    """A worker's listener that closes the connection instead of a hello (here: a token it
    never offered) makes that worker unavailable for the request, which goes elsewhere."""
    if transport != "tcp":
        pytest.skip("the TCP transport's handshake")
    refusing, healthy = FakeWorker("finish"), FakeWorker("finish")

    async def wrong_token(channel_id):
        endpoint = await refusing._open_socket(channel_id)
        return dataclasses.replace(endpoint, token="0" * 32)
    refusing.open_socket_channel = _Method(wrong_token)
    fe, router = _frontend(refusing, healthy)

    async def main():  # no channels opened ahead: the request's placement opens them
        choices, streams = await fe.start([[1, 2, 3]], [{"max_new_tokens": 4}])
        await asyncio.wait_for(fe.run_to_end(choices, streams), 5)
        return choices[0]
    choice = asyncio.run(main())
    assert choice.error is None and choice.meta.worker_id == "w1"
    assert router.released == [("w0", False), ("w1", True)]
