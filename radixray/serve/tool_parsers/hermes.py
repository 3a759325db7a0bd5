"""Hermes-style tool calls, as Qwen2.5, Qwen3 and NousResearch Hermes models write them::

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "CET"}}
    </tool_call>

One call per ``<tool_call>`` block, any number of blocks; text before, between and after
the blocks is content. ``"parameters"`` is taken for ``"arguments"``. A block whose closing
``</tool_call>`` never comes still ends its call when the object closes (the generation
stopped there). Streaming and failure rules: stream.py.
"""

from __future__ import annotations

from radixray.serve.tool_parsers import grammar
from radixray.serve.tool_parsers.stream import FAIL, MORE, StreamingCallParser, lit, match_seq

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def _tag(tool: dict) -> dict:
    name = tool["function"]["name"]
    return grammar.tag(f'{OPEN}\n{{"name": "{name}", "arguments": ', tool, f"}}\n{CLOSE}")


class HermesParser(StreamingCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""

    name = "hermes"

    def _step_format(self, state: str, at_end: bool) -> bool:
        if state == "text":
            return self._step_text((OPEN,), at_end)
        if state == "open":  # after <tool_call>: whitespace, then the call object
            if (waited := self._after_ws(at_end, fail=True)) is not None:
                return waited
            if self._buf[0] != "{":
                return self._fail_region()
            self._start_call()
            return True
        if state == "close":  # after the call object: whitespace, then </tool_call>
            if (waited := self._after_ws(at_end, fail=False)) is not None:
                return waited
            got = match_seq(self._buf, 0, (lit(CLOSE),), at_end)
            if got == MORE:
                return False
            if got != FAIL:
                self._take(got[0])
            elif at_end and CLOSE.startswith(self._buf):  # the text ended inside the marker
                self._take(len(self._buf))
            self._end_region()
            return True
        raise AssertionError(state)

    def _after_call(self) -> None:
        self._state = "close"

    @classmethod
    def forced_call(cls, tools: list[dict], name: str | None, parallel: bool = True) -> dict:
        """Only ``<tool_call>`` blocks: exactly one, of ``name``, when given; else at least
        one of any tool, separated by a newline (exactly one when ``parallel`` is False)."""
        return grammar.forced(tools, name, _tag, "\n", parallel)

    @classmethod
    def triggered_call(cls, tools: list[dict], parallel: bool = True) -> dict:
        """For ``tool_choice: auto``: free text, and every ``<tool_call>`` block the model
        opens is a valid call of one of the tools."""
        return grammar.triggered(grammar.chosen(tools, None), _tag, OPEN, parallel)
