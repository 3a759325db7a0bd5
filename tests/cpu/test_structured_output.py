"""Structured output with xgrammar: JSON schemas, regex and EBNF constrain what a random-weight
model writes, through the engine in-process and through the served OpenAI and native APIs.

The tiny model writes garbage, so only the grammar makes its output valid. Schemas bound every
string (enum, bounded pattern) and number (minimum/maximum), and the served engine allows one
whitespace character in a row, so a model that loops inside a value cannot run to max_tokens.
"""

import json
import re
import threading

import jsonschema  # noqa: F401
import pytest
from serving_helpers import free_port, metric, served, tiny_config  # noqa: F401

from radixray.engine.grammar.backend import GrammarBackend
from radixray.engine.grammar.spec import GrammarSpec

NAME = {"type": "string", "pattern": "^[a-z]{1,8}$"}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}


def _obj(props: dict, required=None, extra=False) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None
            else required, "additionalProperties": extra}


SCHEMAS = [
    _obj({"name": NAME}),
    _obj({"age": SMALL_INT}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj({"status": {"type": "string", "enum": ["open", "closed"]}, "count": SMALL_INT}),
    _obj({"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}),
    _obj({"point": _obj({"x": SMALL_INT, "y": SMALL_INT})}),
    _obj({"user": _obj({"name": NAME, "address": _obj({"zip": {"type": "string",
                                                               "pattern": "^[0-9]{5}$"}})})}),
    _obj({"a": NAME, "b": SMALL_INT}, required=["a"]),
    _obj({"id": {"type": "integer", "minimum": 10, "maximum": 20}}),
    _obj({"temp": {"type": "integer", "minimum": -5, "maximum": 5}}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}),
    _obj({"items": {"type": "array", "items": _obj({"k": SMALL_INT}), "minItems": 2,
                    "maxItems": 2}}),
    _obj({"flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 0,
                    "maxItems": 4}}),
    _obj({"kind": {"const": "fixed"}, "n": SMALL_INT}),
    _obj({"x": {"anyOf": [SMALL_INT, {"type": "null"}]}}),
    _obj({"level": {"enum": [1, 2, 3]}, "name": NAME}),
    {"type": "array", "items": SMALL_INT, "minItems": 1, "maxItems": 3},
    _obj({"m": {"type": "array", "items": {"type": "array", "items": SMALL_INT, "minItems": 1,
                                           "maxItems": 2}, "minItems": 1, "maxItems": 2}}),
    _obj({"first": NAME, "last": NAME, "nick": NAME}, required=["first", "last"]),
]
assert len(SCHEMAS) == 20


# ---- units: the compiled-grammar cache ---------------------------------------------------
@pytest.fixture
def backend():
    from model_fixtures import byte_bpe_tokenizer
    tok = byte_bpe_tokenizer()
    b = GrammarBackend(tok, len(tok) + 5, [tok.eos_token_id], threads=1, cache_size=2)
    yield b
    b.close()


def test_same_text_compiles_once(backend):
    spec = GrammarSpec("regex", "[a-z]{3}")
    first = backend.compile(spec)
    assert backend.compile(GrammarSpec("regex", "[a-z]{3}")) is first
    first.result(timeout=60)
    assert (backend.compiles, backend.cache_hits) == (1, 1)
    backend.compile(GrammarSpec("regex", "x"))
    backend.compile(GrammarSpec("regex", "y")).result(timeout=60)
    assert backend.cached(spec) is None  # the least recently used entry left (cache_size 2)


def test_a_grammar_that_fails_to_compile_is_cached_as_failed(backend):
    spec = GrammarSpec("ebnf", 'root ::= undefined_rule')
    with pytest.raises(ValueError, match="ebnf: xgrammar cannot compile it: .*undefined_rule"):
        backend.compile(spec).result(timeout=60)
    with pytest.raises(ValueError):
        backend.compile(spec).result(timeout=0)  # the cached failure, at once
    assert (backend.compiles, backend.compile_failures, backend.cache_hits) == (1, 1, 1)


# ---- in-process engine -------------------------------------------------------------------
@pytest.mark.parametrize("params, field", [
    ({"regex": "[a-"}, "regex"),
    ({"ebnf": "root ::= foo"}, "ebnf"),
    ({"json_schema": '{"type": "strng"}'}, "json_schema"),
    ({"json_schema": "not json"}, "json_schema"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "regex', 'ebnf"),
])
def test_bad_constraints_are_refused_before_scheduling(eng, params, field):
    with pytest.raises(ValueError, match=field):
        eng.generate("hello", {"max_new_tokens": 4, **params})
    assert eng.check_kv_conservation()["waiting"] == 0


def _escape(text: str) -> str:
    """``text`` as a regex matching exactly it."""
    return "".join("\\" + c if c in r"\.^$*+?()[]{}|/-" else c for c in text)


def _clean_prefix(tokenizer, ids: list[int]) -> list[int]:
    """The longest prefix of ``ids`` that decodes to printable ASCII (a random model also
    writes byte tokens that are not UTF-8 on their own), before any special token."""
    special = set(tokenizer.all_special_ids)
    k = next((i for i, t in enumerate(ids) if t in special), len(ids))
    while k and not re.fullmatch(r"[ -~]+", tokenizer.decode(ids[:k])):
        k -= 1
    return ids[:k]


def test_greedy_output_the_grammar_admits_is_unchanged(eng):
    checked = 0
    # prompts whose greedy output starts with a few printable tokens (found by trying)
    for prompt in ("quick brown", "dog hello", "a"):
        free = eng.generate(prompt, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
        ids = _clean_prefix(eng.tokenizer, free["output_ids"])
        if len(ids) < 3:
            continue
        text = eng.tokenizer.decode(ids)
        for constraint in ({"regex": _escape(text)}, {"ebnf": f"root ::= {json.dumps(text)}"}):
            got = eng.generate(prompt, {"max_new_tokens": 20, "temperature": 0, **constraint})
            # the same greedy tokens; then the grammar allows only EOS, which ends the request
            assert got["output_ids"][:len(ids)] == ids, constraint
            assert got["text"] == text and got["meta_info"]["finish_reason"]["type"] == "stop"
        checked += 1
    assert checked >= 2


def test_a_request_waits_for_its_grammar_while_others_run(eng):
    release, entered = threading.Event(), threading.Event()
    slow = "(held|queue) [0-9]{2}"
    backend = eng.scheduler.grammar.backend

    def hook(spec):
        if spec.text == slow:
            entered.set()
            assert release.wait(120)
    backend.compile_hook = hook
    results = {}
    t = threading.Thread(target=lambda: results.update(held=eng.generate(
        "a b", {"max_new_tokens": 16, "temperature": 0, "regex": slow})))
    try:
        t.start()
        assert entered.wait(60)
        other = eng.generate("hello", {"max_new_tokens": 5, "temperature": 0, "regex": "[a-z]+"})
        assert re.fullmatch("[a-z]+", other["text"])
        assert eng.call_in_loop(lambda s: len(s.grammar.queue)) == 1  # still compiling
    finally:
        release.set()
        t.join(120)
        backend.compile_hook = None
    assert re.fullmatch(slow, results["held"]["text"])


def test_a_compile_failure_in_the_engine_ends_the_request_with_a_400(eng):
    backend = eng.scheduler.grammar.backend

    def hook(spec):
        raise ValueError(f"{spec.field}: refused by the test hook")
    backend.compile_hook = hook
    try:
        out = eng.generate("x", {"max_new_tokens": 4, "regex": "[0-9]{7}"})
    finally:
        backend.compile_hook = None
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "error" and reason["status"] == 400
    assert "refused by the test hook" in reason["message"]
    out = eng.generate("x", {"max_new_tokens": 4, "regex": "[0-9]{7}"})  # cached as failed
    assert out["meta_info"]["finish_reason"]["status"] == 400


def test_sampled_choices_each_follow_their_grammar_through_retraction(eng):
    def retract_once(s):  # every constrained request is sent back once, mid-output
        for r in [r for r in s.running if r.grammar is not None and len(r.output_ids) >= 4
                  and r.num_retractions == 0]:
            s.retract(r)
    eng.scheduler.on_step = retract_once
    try:
        outs = eng.generate(["one two"] * 4, {"max_new_tokens": 40, "temperature": 1.0,
                                              "seed": 3, "regex": "(ab|cd){8,15}"})
    finally:
        eng.scheduler.on_step = None
    for out in outs:
        assert re.fullmatch("(ab|cd){8,15}", out["text"]), out["text"]
        assert out["meta_info"]["num_retractions"] == 1
