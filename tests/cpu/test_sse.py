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
