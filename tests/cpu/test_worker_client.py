"""The ingress side of a worker channel, against a stand-in actor handle (no Ray).

Covers what is hard to provoke on a real cluster: a health probe that times out
cancels its request on the worker, and a worker that dies mid-request ends the
request with an error instead of hanging it.
"""

import asyncio

import pytest
from model_fixtures import byte_bpe_tokenizer

from radixray.cluster.frontend import Frontend
from radixray.cluster.worker_client import WorkerClient


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)

    def options(self, **_):
        return self


class FakeWorker:
    """Speaks the EngineWorker channel protocol; ``script`` decides what a submit produces."""

    def __init__(self, die_after_submit: bool = False):
        self.aborted: list[list[str]] = []
        self.submitted: list[dict] = []
        self.die_after_submit = die_after_submit
        self.outbox: asyncio.Queue | None = None
        self.stream = _Method(self._stream)
        self.submit = _Method(self._submit)
        self.abort = _Method(lambda rids: self.aborted.append(list(rids)))

    async def _ref(self, value):
        if isinstance(value, Exception):
            raise value
        return value

    async def _stream(self, channel_id):
        self.outbox = asyncio.Queue()
        yield self._ref({"control": "open", "draining": False})
        while True:
            yield self._ref(await self.outbox.get())

    async def _submit(self, channel_id, requests):
        self.submitted.extend(requests)
        if self.die_after_submit:
            self.outbox.put_nowait(RuntimeError("worker process died"))


def _frontend(worker: FakeWorker) -> Frontend:
    info = {"context_len": 64, "vocab_size": 400, "model": "fake", "worker_id": "w0"}
    return Frontend(byte_bpe_tokenizer(), info, "fake", WorkerClient(worker, "w0"))


def test_timed_out_probe_aborts_its_request():
    worker = FakeWorker()  # never answers

    async def main():
        fe = _frontend(worker)
        await fe.client.start()
        choices, streams = await fe.start([[1, 2, 3]], [{"max_new_tokens": 1}])
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(fe.run_to_end(choices, streams), 0.2)
        return choices[0].rid, fe.client
    rid, client = asyncio.run(main())
    assert worker.aborted == [[rid]]
    assert client._queues == {}  # nothing left waiting


def test_worker_death_ends_requests_with_an_error():
    worker = FakeWorker(die_after_submit=True)

    async def main():
        fe = _frontend(worker)
        await fe.client.start()
        choices, streams = await fe.start([[1, 2, 3]], [{"max_new_tokens": 4}])
        await asyncio.wait_for(fe.run_to_end(choices, streams), 5)
        return choices[0], fe.client
    choice, client = asyncio.run(main())
    assert choice.finished and "worker process died" in choice.error
    assert not client.alive
