"""Server-sent events: one event is one line of JSON for every line-splitting client."""

from __future__ import annotations

import json

import httpx

from radixray.serve.openai_serving import SSE_DONE, sse


def test_event_stays_on_one_line_for_splitlines_clients():
    # U+2028/U+2029 and NEL are legal unescaped in JSON but split lines in str.splitlines()
    # and httpx's iter_lines; random-weight models generate them.
    text = "a\u2028b\x85c\u2029d\né\U0001f600"
    event = sse({"text": text})
    lines = [line for line in event.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:]) == {"text": text}
    decoded = httpx._decoders.LineDecoder().decode(event + SSE_DONE)
    assert [line for line in decoded if line] == [lines[0], "data: [DONE]"]
    assert "é" in event  # other non-ASCII text is sent as is


def test_a_response_cancelled_while_sending_closes_its_stream():
    """The client left while a chunk was being sent (the cancellation lands in ``send``,
    not in the stream): the stream's cleanup (which aborts its request) runs at once."""
    import asyncio

    from radixray.serve.ingress import ClosingStreamingResponse
    closed = []

    async def stream():
        try:
            while True:
                yield "data: x\n\n"
        finally:
            closed.append(True)

    async def receive():
        await asyncio.sleep(3600)

    async def send(message):
        if message["type"] == "http.response.body":
            raise asyncio.CancelledError

    async def main():
        response = ClosingStreamingResponse(stream(), media_type="text/event-stream")
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        try:
            await response(scope, receive, send)
        except asyncio.CancelledError:
            pass
        return list(closed)  # at once, not when the loop shuts its generators down
    assert asyncio.run(main()) == [True]
