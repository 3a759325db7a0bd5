"""Llama 3.1 / 3.2 / 3.3 JSON tool calls, as their chat templates ask for them::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

or several, separated by ``;``, optionally after ``<|python_tag|>``::

    <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}

A call region opens at ``<|python_tag|>`` anywhere in the text, or at a ``{`` that is the
first non-whitespace character of the output (a model answering with plain JSON that is not
a call gets it back as content). ``"arguments"`` is taken for ``"parameters"``.
``<|python_tag|>`` is a special token: decode with ``skip_special_tokens=False`` to see it.
Streaming and failure rules: stream.py.
"""

from __future__ import annotations

from radixray.serve.tool_parsers import grammar
from radixray.serve.tool_parsers.stream import StreamingCallParser

PYTHON_TAG = "<|python_tag|>"
_WS = " \t\n\r"


def _tag(tool: dict) -> dict:
    return grammar.tag(f'{{"name": "{tool["function"]["name"]}", "parameters": ', tool, "}")


class Llama3JsonParser(StreamingCallParser):
    """``{"name": ..., "parameters": {...}}`` calls, ``;``-separated."""

    name = "llama3"

    def _step_format(self, state: str, at_end: bool) -> bool:
        if state == "text":
            if not self._started:  # the output's first non-whitespace char may open calls
                stripped = self._buf.lstrip(_WS)
                if not stripped:
                    if at_end:
                        self._emit_text(self._buf)
                        self._buf = ""
                    return False
                self._started = True
                if stripped[0] == "{":
                    self._take(len(self._buf) - len(stripped))
                    self._start_call()
                    return True
            return self._step_text((PYTHON_TAG,), at_end)
        if state == "open":  # after <|python_tag|> or ';': whitespace, then a call object
            # a ';' after the last call is dropped with the region
            if (waited := self._after_ws(at_end, fail=not self._region.startswith(";"))) \
                    is not None:
                return waited
            if self._buf[0] != "{":
                return self._fail_region()
            self._start_call()
            return True
        if state == "sep":  # after a call: ';' and another call, or the region ends
            if (waited := self._after_ws(at_end, fail=False)) is not None:
                return waited
            if self._buf[0] == ";":
                self._take(1)
                self._state = "open"
            else:
                self._end_region()
            return True
        raise AssertionError(state)

    def _after_call(self) -> None:
        self._state = "sep"

    @classmethod
    def forced_call(cls, tools: list[dict], name: str | None, parallel: bool = True) -> dict:
        """Only calls: exactly one, of ``name``, when given; else at least one of any tool,
        joined by ``"; "`` (exactly one when ``parallel`` is False)."""
        return grammar.forced(tools, name, _tag, "; ", parallel)

    @classmethod
    def triggered_call(cls, tools: list[dict], parallel: bool = True) -> dict:
        """For ``tool_choice: auto``: either the output is calls (as :meth:`forced_call`
        with ``name`` None), or it is text in which ``{"name"`` does not occur (a call
        cannot start mid-text, where this parser would not read it). Calls after
        ``<|python_tag|>`` are not constrained."""
        calls = grammar.calls_format(grammar.chosen(tools, None), _tag, "; ", parallel)
        return grammar.structural_tag({"type": "or", "elements": [
            calls, {"type": "any_text", "excludes": ['{"name"']}]})
