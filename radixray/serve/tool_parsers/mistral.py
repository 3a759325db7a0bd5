"""Mistral tool calls: the JSON list form (Mistral 7B v0.3, Nemo, Small 3.x templates)::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

and the newer name form (tokenizer v11+), one marker per call, with an optional call id::

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}

A single object after the marker (no list) is read as one call. Text before the marker is
content. ``[TOOL_CALLS]``, ``[ARGS]`` and ``[CALL_ID]`` are special tokens: decode with
``skip_special_tokens=False`` to see them. The call id a model writes is not kept (the chat
API assigns its own). Streaming and failure rules: stream.py.
"""

from __future__ import annotations

from radixray.serve.tool_parsers import grammar
from radixray.serve.tool_parsers.stream import (
    IDENT,
    MORE,
    WS,
    StreamingCallParser,
    lit,
    match_seq,
)

MARKER = "[TOOL_CALLS]"
_NAME_FORMS = ((IDENT, lit("[ARGS]"), WS),
               (IDENT, lit("[CALL_ID]"), IDENT, lit("[ARGS]"), WS))


def _tag(tool: dict) -> dict:
    return grammar.tag(f'{{"name": "{tool["function"]["name"]}", "arguments": ', tool, "}")


class MistralParser(StreamingCallParser):
    """``[TOOL_CALLS][{...}, ...]`` lists and ``[TOOL_CALLS]name[ARGS]{...}`` calls."""

    name = "mistral"

    def __init__(self, tools: list[dict]):
        super().__init__(tools)
        self._in_list = False

    def _step_format(self, state: str, at_end: bool) -> bool:
        if state == "text":
            return self._step_text((MARKER,), at_end)
        if state == "open":  # after [TOOL_CALLS]: a list, an object, or a name
            if (waited := self._after_ws(at_end, fail=True)) is not None:
                return waited
            first = self._buf[0]
            if first in "[{":
                self._in_list = first == "["
                if self._in_list:
                    self._take(1)
                    self._state = "item"
                else:
                    self._start_call()
                return True
            return self._name_form(at_end)
        if state == "item":  # inside the list: a call object, or the list's end
            if (waited := self._after_ws(at_end, fail=True)) is not None:
                return waited
            if self._buf[0] == "{":
                self._start_call()
            elif self._buf[0] == "]":
                self._take(1)
                self._end_region()
            else:
                return self._fail_region()
            return True
        if state == "sep":  # after a call in the list: ',' and another, or ']'
            if (waited := self._after_ws(at_end, fail=False)) is not None:
                return waited
            if self._buf[0] == ",":
                self._take(1)
                self._state = "item"
            else:
                if self._buf[0] == "]":
                    self._take(1)
                self._end_region()
            return True
        raise AssertionError(state)

    def _name_form(self, at_end: bool) -> bool:
        results = [match_seq(self._buf, 0, form, at_end) for form in _NAME_FORMS]
        got = next((r for r in results if isinstance(r, tuple)), None)
        if got is None:
            return False if MORE in results else self._fail_region()
        end, captures = got
        name = captures[0]
        if name not in self.tool_names or self._buf[end:end + 1] != "{":
            return self._fail_region()
        self._take(end)
        self._in_list = False
        self._start_args(name)
        return True

    def _after_call(self) -> None:
        if self._in_list:
            self._state = "sep"
        else:
            self._end_region()

    @classmethod
    def forced_call(cls, tools: list[dict], name: str | None, parallel: bool = True) -> dict:
        """Only ``[TOOL_CALLS][...]``: a list of exactly one call of ``name``, when given;
        else of at least one call of any tool, joined by ``", "`` (exactly one when
        ``parallel`` is False). The marker is
        matched as text: with a tokenizer where ``[TOOL_CALLS]`` is a special token the
        model must be able to write it as text."""
        return grammar.forced(tools, name, _tag, ", ", parallel,
                              prefix=MARKER + "[", suffix="]")

    @classmethod
    def triggered_call(cls, tools: list[dict], parallel: bool = True) -> dict:
        """For ``tool_choice: auto``: free text, and a ``[TOOL_CALLS]`` list the model opens
        holds valid calls only."""
        calls = grammar.calls_format(grammar.chosen(tools, None), _tag, ", ", parallel)
        return grammar.structural_tag({
            "type": "triggered_tags", "triggers": [MARKER], "at_least_one": False,
            "stop_after_first": True,
            "tags": [{"type": "tag", "begin": MARKER + "[", "content": calls, "end": "]"}]})
