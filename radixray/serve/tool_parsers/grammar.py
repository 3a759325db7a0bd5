"""Structural tags (xgrammar's JSON format, ``{"type": "structural_tag", "format": ...}``)
that constrain a generation to tool calls in one syntax.

A call is a *tag*: a fixed ``begin`` that carries the function's name, the arguments under
the function's ``parameters`` JSON schema, and a fixed ``end``. Formats compose tags:

- :func:`forced` (``tool_choice`` a named function, or ``"required"``): nothing but calls,
  at least one; several, joined by the format's separator, unless ``parallel`` is False;
- :func:`triggered` (``tool_choice`` ``"auto"``): free text, but once the text reaches the
  trigger (hermes ``<tool_call>``) the call that follows is constrained.

The result is the engine's ``structural_tag`` sampling param (JSON text). The engine applies
its ``grammar_json_max_whitespace`` to the JSON inside, so a served model cannot loop on
whitespace between tokens of the arguments.
"""

from __future__ import annotations

import json
from collections.abc import Callable

# a function without "parameters" takes none (the OpenAI API's meaning)
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def parameters_of(tool: dict) -> dict:
    """The JSON schema of a tool's arguments."""
    params = tool["function"].get("parameters")
    return NO_PARAMETERS if params is None else params


def tool_names(tools: list[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def chosen(tools: list[dict], name: str | None) -> list[dict]:
    """The tools a forced call may use: the named one, or all; ValueError naming
    ``tool_choice`` when the name is not among the tools (or there are none)."""
    if not tools:
        raise ValueError("tool_choice: a call is required but no tools were given")
    if name is None:
        return tools
    picked = [t for t in tools if t["function"]["name"] == name]
    if not picked:
        raise ValueError(f"tool_choice: function {name!r} is not among the tools "
                         f"{tool_names(tools)}")
    return picked


def tag(begin: str, tool: dict, end: str) -> dict:
    return {"type": "tag", "begin": begin,
            "content": {"type": "json_schema", "json_schema": parameters_of(tool)},
            "end": end}


def forced(tools: list[dict], name: str | None, make_tag: Callable[[dict], dict],
           separator: str, parallel: bool, prefix: str = "", suffix: str = "") -> dict:
    """Sampling params: only calls (``make_tag`` of each tool), inside ``prefix``/``suffix``.
    ``name`` given: exactly one call, of that function. None: at least one call of any of
    the tools, joined by ``separator``; exactly one when ``parallel`` is False."""
    picked = chosen(tools, name)
    return structural_tag(calls_format(picked, make_tag, separator,
                                       parallel and name is None, prefix, suffix))


def calls_format(tools: list[dict], make_tag: Callable[[dict], dict], separator: str,
                 parallel: bool, prefix: str = "", suffix: str = "") -> dict:
    """The structural-tag format of :func:`forced`."""
    tags = [make_tag(t) for t in tools]
    if len(tags) == 1 and not parallel:
        body = tags[0]
    else:
        body = {"type": "tags_with_separator", "tags": tags, "separator": separator,
                "at_least_one": True, "stop_after_first": not parallel}
    if prefix or suffix:
        body = {"type": "sequence", "elements": [
            *([{"type": "const_string", "value": prefix}] if prefix else []), body,
            *([{"type": "const_string", "value": suffix}] if suffix else [])]}
    return body


def triggered(tools: list[dict], make_tag: Callable[[dict], dict], trigger: str,
              parallel: bool) -> dict:
    """Sampling params: free text in which each call, once ``trigger`` starts it, is
    constrained (no call at all is fine; one only when ``parallel`` is False)."""
    return structural_tag({"type": "triggered_tags", "triggers": [trigger],
                           "tags": [make_tag(t) for t in tools], "at_least_one": False,
                           "stop_after_first": not parallel})


def structural_tag(fmt: dict) -> dict:
    """The engine sampling params of one structural-tag format."""
    return {"structural_tag": json.dumps({"type": "structural_tag", "format": fmt},
                                         ensure_ascii=False)}
