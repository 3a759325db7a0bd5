"""Reasoning output (``<think>...</think>``) split from the answer, whole-text and streaming.

A :class:`ReasoningParser` is chosen by ``--reasoning-parser`` (:data:`REASONING_PARSERS`):

- ``deepseek-r1``: the chat template already opened ``<think>`` in the prompt, so the output
  starts inside the reasoning; an opening ``<think>`` in the output is taken too. Output
  without ``</think>`` is all reasoning (the generation stopped while thinking).
- ``qwen3``: reasoning only when the output opens with ``<think>``; otherwise (Qwen3 with
  ``enable_thinking: false``, whose template pre-fills an empty block) it is all content.
- ``qwen3-thinking``: as ``deepseek-r1`` (Qwen3 thinking-only models open ``<think>`` in
  the template).

With ``enable_thinking=False`` (the request's ``chat_template_kwargs``) every parser passes
the text through as content. :meth:`ReasoningParser.after_reasoning` moves a request's
structured-output constraint (a forced tool call, a JSON schema) past the reasoning block, so
a reasoning model thinks freely before the constrained part.

Contracts: ``split(text)`` returns ``(reasoning, content)``: ``reasoning`` is the text of the
block, stripped, None when there is none or it is empty; ``content`` is the rest (what the
tool-call parser reads next), its leading whitespace after ``</think>`` dropped. ``feed`` /
``flush`` stream the same split: joined reasoning deltas equal ``reasoning`` (or ""), joined
content deltas equal ``content``. Text that may be the start of a tag, and whitespace that may
turn out to end the reasoning, is held back until known; ``split`` runs the same machine over
the whole text, so the two agree by construction.
"""

from __future__ import annotations

import json
from typing import ClassVar

_WS = " \t\n\r"
# a sampling-params constraint -> the structural-tag format of it
_CONSTRAINTS = {
    "structural_tag": None,  # its own "format"
    "json_schema": lambda schema: {"type": "json_schema", "json_schema": schema},
    "regex": lambda pattern: {"type": "regex", "pattern": pattern},
    "ebnf": lambda text: {"type": "grammar", "grammar": text},
}


class ReasoningParser:
    """The ``<think>...</think>`` family (see the module docstring)."""

    name: ClassVar[str]
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    starts_in_reasoning: ClassVar[bool]  # the template opened the block in the prompt

    def __init__(self, enable_thinking: bool = True):
        self.enable_thinking = enable_thinking
        self._buf = ""
        self._state = "start" if enable_thinking else "content"
        self._saw_reasoning = False

    def split(self, text: str) -> tuple[str | None, str]:
        """Reasoning (None when there is none) and content of a whole generation."""
        fresh = type(self)(self.enable_thinking)
        r1, c1 = fresh.feed(text)
        r2, c2 = fresh.flush()
        return (r1 + r2) or None, c1 + c2

    def feed(self, delta: str) -> tuple[str, str]:
        """Take the next piece of generated text: (reasoning delta, content delta)."""
        self._buf += delta
        return self._run(at_end=False)

    def flush(self) -> tuple[str, str]:
        """The generation ended: release what is held."""
        return self._run(at_end=True)

    def after_reasoning(self, params: dict) -> dict:
        """Engine sampling params whose structured-output constraint (``structural_tag``,
        ``json_schema``, ``regex`` or ``ebnf``) applies after the reasoning block instead
        of from the first token: the block (opened by the template or by the model, as this
        parser expects) is free text up to ``</think>``, then the constraint. ``params``
        unchanged when thinking is off or it has no constraint."""
        kinds = [k for k in _CONSTRAINTS if params.get(k) is not None]
        if not self.enable_thinking or len(kinds) != 1:
            return params
        (kind,) = kinds
        value = params[kind]
        if kind in ("structural_tag", "json_schema") and isinstance(value, str):
            value = json.loads(value)
        constraint = value["format"] if kind == "structural_tag" else _CONSTRAINTS[kind](value)
        block = {"type": "tag", "begin": "" if self.starts_in_reasoning else self.start_tag,
                 "content": {"type": "any_text"},
                 "end": [self.end_tag + "\n\n", self.end_tag + "\n", self.end_tag]}
        out = {k: v for k, v in params.items() if k != kind}
        out["structural_tag"] = json.dumps({"type": "structural_tag", "format": {
            "type": "sequence", "elements": [block, constraint]}}, ensure_ascii=False)
        return out

    # ---- the machine -----------------------------------------------------------------------
    def _run(self, at_end: bool) -> tuple[str, str]:
        reasoning, content = [], []
        while True:
            state, buf = self._state, self._buf
            if state == "content":
                content.append(buf)
                self._buf = ""
                break
            if state == "start":  # before anything: the opening tag, or not
                head = buf.lstrip(_WS)
                if head.startswith(self.start_tag):
                    self._buf = head[len(self.start_tag):]
                    self._state = "reasoning_ws"
                    continue
                if not at_end and self.start_tag.startswith(head):
                    break  # may still be the tag (or only whitespace so far)
                self._state = "reasoning_ws" if self.starts_in_reasoning else "content"
                if self.starts_in_reasoning:
                    self._buf = head
                continue
            if state in ("reasoning_ws", "after_ws"):  # leading whitespace is dropped
                self._buf = buf.lstrip(_WS)
                if not self._buf and not at_end:
                    break
                self._state = "reasoning" if state == "reasoning_ws" else "content"
                continue
            # state == "reasoning"
            i = buf.find(self.end_tag)
            if i >= 0:
                reasoning.append(buf[:i].rstrip(_WS))
                self._buf = buf[i + len(self.end_tag):]
                self._state = "after_ws"
                continue
            if at_end:
                reasoning.append(buf.rstrip(_WS))
                self._buf = ""
                break
            keep = len(buf) - _partial_suffix(buf, self.end_tag)
            keep = len(buf[:keep].rstrip(_WS))
            reasoning.append(buf[:keep])
            self._buf = buf[keep:]
            break
        return "".join(reasoning), "".join(content)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek-r1"
    starts_in_reasoning = True


class Qwen3Parser(ReasoningParser):
    name = "qwen3"
    starts_in_reasoning = False


class Qwen3ThinkingParser(ReasoningParser):
    name = "qwen3-thinking"
    starts_in_reasoning = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1Parser, Qwen3Parser, Qwen3ThinkingParser)}


def reasoning_parser(name: str, enable_thinking: bool = True) -> ReasoningParser:
    """A fresh parser called ``name`` (one per choice); ValueError listing the known names."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser {name!r} is not known; known: "
                         f"{sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name](enable_thinking)
