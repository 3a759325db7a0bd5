"""Step messages over TCP (cluster/step_socket.py): frames, the one-time token, and which
end's closing ends what."""

import asyncio

from radixray.cluster.step_socket import StepSocketServer, frame, read_frame, write_messages


class Channel:
    """An offered channel's messages: what the test puts in ``queue`` (None ends it);
    ``closed`` once its generator was closed (the worker aborts the requests then)."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = asyncio.Event()
        self.served: list[str] = []

    async def messages(self):
        try:
            while (message := await self.queue.get()) is not None:
                yield message
        finally:
            self.closed.set()

    async def serve(self, channel_id, reader, writer):
        self.served.append(channel_id)
        await write_messages(self.messages(), reader, writer)


async def _listening(channel: Channel) -> StepSocketServer:
    return StepSocketServer("127.0.0.1", channel.serve)


async def _connect(endpoint, token: str | None = None):
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    writer.write((token or endpoint.token).encode() + b"\n")
    return reader, writer


def test_messages_arrive_in_order_as_sent_and_the_workers_end_closes_the_connection():
    async def main():
        channel = Channel()
        server = await _listening(channel)
        endpoint = await server.offer("ingress-1")
        reader, writer = await _connect(endpoint)
        sent = [["step", 1], {"state": "draining"}, list(range(1000))]
        for message in sent:
            channel.queue.put_nowait(message)
        got = [await read_frame(reader) for _ in sent]
        channel.queue.put_nowait(None)  # the worker closes the channel
        assert await reader.read() == b""  # EOF
        writer.close()
        server.close()
        return got, channel.served
    got, served = asyncio.run(main())
    assert got == [["step", 1], {"state": "draining"}, list(range(1000))]
    assert served == ["ingress-1"]


def test_the_readers_going_away_closes_the_channel():
    async def main():
        channel = Channel()
        server = await _listening(channel)
        reader, writer = await _connect(await server.offer("ingress-2"))
        channel.queue.put_nowait("hello")
        assert await read_frame(reader) == "hello"
        writer.close()  # the ingress goes away with no message in flight
        await asyncio.wait_for(channel.closed.wait(), 5)
        server.close()
    asyncio.run(main())


def test_a_connection_without_an_offered_token_gets_nothing():
    async def main():
        channel = Channel()
        server = await _listening(channel)
        endpoint = await server.offer("ingress-3")
        reader, writer = await _connect(endpoint, token="0" * 32)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing sent
        # a token is good once: the right one works, then not again
        reader, writer = await _connect(endpoint)
        channel.queue.put_nowait("step")
        assert await read_frame(reader) == "step"
        again, _ = await _connect(endpoint)
        assert await asyncio.wait_for(again.read(), 5) == b""
        writer.close()
        server.close()
        return channel.served
    assert asyncio.run(main()) == ["ingress-3"]


def test_a_frame_is_its_pickles_length_then_the_pickle():
    import pickle
    import struct
    data = frame({"a": [1, 2]})
    (size,) = struct.unpack("<I", data[:4])
    assert size == len(data) - 4 and pickle.loads(data[4:]) == {"a": [1, 2]}


def test_offers_made_at_once_share_one_listener():
    """Two ingress replicas asking a worker at the same moment: one listener, two channels."""
    async def main():
        channels = {"a": Channel(), "b": Channel()}

        async def serve(channel_id, reader, writer):
            await channels[channel_id].serve(channel_id, reader, writer)
        server = StepSocketServer("127.0.0.1", serve)
        first, second = await asyncio.gather(server.offer("a"), server.offer("b"))
        assert first.port == second.port and first.token != second.token
        readers = [await _connect(e) for e in (first, second)]
        for name in ("a", "b"):
            channels[name].queue.put_nowait(f"step of {name}")
        got = [await asyncio.wait_for(read_frame(r), 5) for r, _ in readers]
        for _, w in readers:
            w.close()
        server.close()
        return got
    assert asyncio.run(main()) == ["step of a", "step of b"]
