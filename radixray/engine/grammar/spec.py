"""What a request constrains its output to, and the cheap syntax check done before scheduling.

A request carries at most one constraint in its sampling params: ``json_schema``, ``regex``,
``ebnf`` or ``structural_tag`` (the OpenAI ``response_format`` maps onto ``json_schema``; the
chat API's forced tool calls onto ``structural_tag``, xgrammar's JSON format
``{"type": "structural_tag", "format": {...}}``). :class:`GrammarSpec`
is that constraint as a hashable key (kind, text) for the compiled-grammar cache.

:func:`check_syntax` parses the constraint without a tokenizer (xgrammar's ``Grammar``), so
a schema, regex or EBNF that xgrammar rejects is a ``ValueError`` naming the field on the
caller's thread, before anything is scheduled. xgrammar is imported lazily: requests
without a constraint never load it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
# What response_format {"type": "json_object"} asks for: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and may carry a
# "Check failed: (...) is false: " clause; neither helps a client.
_CPP_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false:\s*")


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint: ``kind`` in :data:`KINDS` and its text (a JSON schema as a string)."""

    kind: str
    text: str

    @property
    def field(self) -> str:
        """The sampling-params field the constraint came from (for error messages)."""
        return self.kind


def spec_of(params) -> GrammarSpec | None:
    """The constraint of ``params`` (a SamplingParams), None when it has none. ValueError
    naming the fields when more than one is set: a request takes exactly one."""
    given = [k for k in KINDS if getattr(params, k, None) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"give at most one structured-output constraint; got {given} "
                         f"({', '.join(KINDS)} are exclusive)")
    kind = given[0]
    text = getattr(params, kind)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{kind} must be a non-empty string, got {text!r}")
    return GrammarSpec(kind, text)


def clean_error(exc: BaseException) -> str:
    """xgrammar's error text without its C++ source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _CHECK_FAILED.sub("", _CPP_PREFIX.sub("", text)).strip()


def parse(spec: GrammarSpec):
    """The xgrammar ``Grammar`` of ``spec`` (no tokenizer needed); ValueError naming the field
    and xgrammar's reason when it does not parse."""
    import xgrammar as xgr
    build = {"json_schema": xgr.Grammar.from_json_schema, "regex": xgr.Grammar.from_regex,
             "ebnf": xgr.Grammar.from_ebnf,
             "structural_tag": xgr.Grammar.from_structural_tag}[spec.kind]
    try:
        return build(spec.text)
    except Exception as exc:  # xgrammar raises RuntimeError (and others) for bad input
        raise ValueError(f"{spec.field}: xgrammar cannot compile it: {clean_error(exc)}") from None


def with_max_whitespace(structural_tag: str, limit: int | None) -> str:
    """``structural_tag`` with ``max_whitespace_cnt`` set to ``limit`` on every JSON-schema
    part that does not set its own (the engine's ``grammar_json_max_whitespace`` applies to
    JSON inside structural tags as it does to ``json_schema``). The text unchanged when
    ``limit`` is None or it is not JSON (xgrammar then names the error)."""
    if limit is None:
        return structural_tag
    try:
        tag = json.loads(structural_tag)
    except ValueError:
        return structural_tag

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                node.setdefault("max_whitespace_cnt", limit)
            for key, value in node.items():
                if key != "json_schema":  # a schema itself is not a format
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)
    walk(tag)
    return json.dumps(tag)


def check_syntax(params) -> GrammarSpec | None:
    """Validate the constraint of ``params`` (see :func:`spec_of` and :func:`parse`); return it."""
    spec = spec_of(params)
    if spec is not None:
        parse(spec)
    return spec


def no_structured_output(config) -> str | None:
    """Why an engine with ``config`` (EngineConfig) refuses constrained requests; None if it
    takes them."""
    if config.grammar_backend == "none":
        return "the engine runs with grammar_backend='none'"
    if config.disaggregation_mode is not None:
        return (f"a {config.disaggregation_mode} worker of a prefill-decode pair does not "
                "apply grammars (serve structured output from unified workers)")
    return None
