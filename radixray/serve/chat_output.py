"""One chat choice's generated text split into reasoning, content and tool calls, as the
OpenAI chat API returns them: a whole ``message`` or streamed ``delta`` objects.

The text goes through the reasoning parser first (when the request separates reasoning),
then what is left through the tool-call parser (when the request has tools). Streaming
holds back what may still turn out to be a tag or a call; the deltas joined equal the
whole message (the parsers' contracts, serve/reasoning.py and serve/tool_parsers/base.py).

Each call gets an id (``call_`` and 24 hex digits), sent on its first streamed delta
together with its name; later deltas of the call carry argument fragments only, which is
how the OpenAI client assembles ``tool_calls``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from radixray.serve.chat_parsers import ChatPlan
from radixray.serve.reasoning import reasoning_parser
from radixray.serve.tool_parsers.base import StreamDelta, ToolCallDelta


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ChatDelta:
    """What one piece of generated text released."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class ChoiceOutput:
    """The reasoning/content/calls split of one choice (stateful while streaming)."""

    def __init__(self, plan: ChatPlan):
        self.reasoning = (reasoning_parser(plan.reasoning, plan.enable_thinking)
                          if plan.reasoning else None)
        self.tools = plan.parser(plan.tools) if plan.parser is not None else None
        self.call_ids: list[str] = []  # by call index, as streamed

    # ---- whole text ------------------------------------------------------------------
    def message(self, text: str) -> dict:
        """The assistant ``message`` of a finished generation."""
        reasoning, content = (self.reasoning.split(text) if self.reasoning is not None
                              else (None, text))
        calls = []
        if self.tools is not None:
            parsed = self.tools.parse(content)
            content, calls = parsed.text, parsed.calls
        self.call_ids = [call_id() for _ in calls]
        msg: dict = {"role": "assistant", "content": None if calls and not content else content}
        if self.reasoning is not None:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = [{"id": i, "type": "function", "function": {
                "name": c.name, "arguments": c.arguments}} for i, c in zip(self.call_ids, calls)]
        return msg

    # ---- streaming -------------------------------------------------------------------
    def feed(self, text: str, at_end: bool = False) -> ChatDelta:
        """The next piece of generated text; ``at_end``: the generation ended with it, so
        everything still held back is released too."""
        if self.reasoning is None:
            reasoning, content = "", text
        else:
            reasoning, content = self.reasoning.feed(text)
            if at_end:
                more = self.reasoning.flush()
                reasoning, content = reasoning + more[0], content + more[1]
        return self._tools(reasoning, content, at_end)

    def _tools(self, reasoning: str, content: str, at_end: bool) -> ChatDelta:
        if self.tools is None:
            return ChatDelta(reasoning, content)
        got = self.tools.feed(content) if content else StreamDelta()
        if at_end:
            rest = self.tools.flush()
            got = StreamDelta(got.text + rest.text, got.calls + rest.calls)
        return ChatDelta(reasoning, got.text, got.calls)

    @property
    def has_calls(self) -> bool:
        return bool(self.call_ids)

    def delta_dict(self, delta: ChatDelta) -> dict:
        """The OpenAI ``delta`` object of ``delta`` (pieces of one call merged)."""
        out: dict = {}
        if delta.reasoning:
            out["reasoning_content"] = delta.reasoning
        if delta.content:
            out["content"] = delta.content
        merged: list[dict] = []
        for piece in delta.calls:
            if merged and merged[-1]["index"] == piece.index:
                merged[-1]["function"]["arguments"] += piece.arguments
                continue
            entry: dict = {"index": piece.index, "function": {"arguments": piece.arguments}}
            if piece.name is not None:
                while len(self.call_ids) <= piece.index:
                    self.call_ids.append(call_id())
                entry.update(id=self.call_ids[piece.index], type="function")
                entry["function"] = {"name": piece.name, "arguments": piece.arguments}
            merged.append(entry)
        if merged:
            out["tool_calls"] = merged
        return out


def chat_finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's finish_reason of a chat choice: a generation that stopped after tool calls
    finished for ``tool_calls``."""
    return "tool_calls" if has_calls and reason == "stop" else reason
