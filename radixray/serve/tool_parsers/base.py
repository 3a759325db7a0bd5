"""What every tool-call parser offers the chat API: whole-text parsing, streaming parsing,
and the grammar that forces a call when ``tool_choice`` asks for one.

A parser knows one model family's call syntax (hermes/Qwen ``<tool_call>{...}</tool_call>``,
Llama 3.x JSON, Mistral ``[TOOL_CALLS]``). It is built per choice from the request's tools
(OpenAI ``tools`` entries: ``{"type": "function", "function": {"name", "description",
"parameters"}}``) and is stateful only while streaming.

Contracts shared by every parser:

- ``parse(text)`` splits a finished generation into the text outside calls and the calls.
  A call that does not parse (broken JSON, missing name, a name not among the tools,
  an unterminated block) is not a call: its text stays in ``text``. Precisely: a call
  counts once its header is complete (its marker, and a name among the tools ahead of its
  arguments); before that, anything that goes wrong leaves its text as content. From then
  on its arguments stream, so a call whose arguments break or are cut short (the generation
  ended) keeps the valid part of them, closed (``{"city": "Par`` -> ``{"city": "Par"}``).
  Whitespace between content and a call is not content. (stream.py has the details.)
- ``feed(delta)`` / ``flush()`` stream the same split. The text a client sees, joined over
  every ``StreamDelta.text``, plus the calls assembled from every ``ToolCallDelta`` (the way
  the OpenAI client assembles them: the name once, on a call's first delta, then argument
  fragments to append), equals what ``parse`` returns for the whole text. Text that may be
  the start of a call marker is held back until it is known not to be one; ``flush`` returns
  whatever is still held (a broken call as text).
- ``arguments`` is always a JSON object as text (``"{}"`` for a call without arguments).
- ``forced_call(tools, name)`` is the structured-output constraint (engine sampling params,
  e.g. ``{"json_schema": ...}`` or ``{"structural_tag": ...}``) under which the model can only
  emit calls in this parser's syntax whose arguments validate against the called tool's
  ``parameters`` schema (``name`` None: any of the tools, at least one call; ``name``
  given: exactly one call). ``parallel=False`` (``parallel_tool_calls: false``) allows
  exactly one call. ValueError naming ``tool_choice`` for a name not among the tools.
- ``triggered_call(tools)`` is the constraint for ``tool_choice: auto``: free text, but a
  call the model opens (its marker) must be a valid call of one of the tools.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class ToolCall:
    """One complete call: the function's name and its arguments as JSON object text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParseResult:
    """A finished generation split: ``text`` outside calls (content), and the calls in order."""

    text: str
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of call ``index`` (0-based within the choice): ``name`` on the call's
    first delta only, then fragments of its arguments text to append."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class StreamDelta:
    """What one ``feed`` or ``flush`` releases: content text and call pieces."""

    text: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallParser(ABC):
    """One model family's tool-call syntax (see the module docstring for the contracts)."""

    name: ClassVar[str]  # the --tool-call-parser value that selects it

    def __init__(self, tools: list[dict]):
        self.tools = tools
        self.tool_names = {t["function"]["name"] for t in tools}

    @abstractmethod
    def parse(self, text: str) -> ParseResult:
        """Split a whole generation into content and calls."""

    @abstractmethod
    def feed(self, delta: str) -> StreamDelta:
        """Take the next piece of generated text; release what is now known."""

    @abstractmethod
    def flush(self) -> StreamDelta:
        """The generation ended: release everything still held back."""

    @classmethod
    @abstractmethod
    def forced_call(cls, tools: list[dict], name: str | None, parallel: bool = True) -> dict:
        """Engine sampling params that constrain output to calls of ``tools`` (of ``name``
        only, when given) in this syntax, arguments valid against the tool's schema."""

    @classmethod
    @abstractmethod
    def triggered_call(cls, tools: list[dict], parallel: bool = True) -> dict:
        """Engine sampling params for ``tool_choice: auto``: any text, and each call the
        model opens is a valid call of one of ``tools`` (one only, unless ``parallel``)."""
