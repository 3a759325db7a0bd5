"""Structured output with xgrammar: JSON schemas, regex and EBNF constrain what a random-weight
model writes, through the engine in-process and through the served OpenAI and native APIs.

The tiny model writes garbage, so only the grammar makes its output valid. Schemas bound every
string (enum, bounded pattern) and number (minimum/maximum), and the served engine allows one
whitespace character in a row, so a model that loops inside a value cannot run to max_tokens.
"""

import json
import re
import threading

import httpx
import jsonschema
import pytest
from schema_fixtures import SCHEMAS
from serving_helpers import free_port, metric, served, tiny_config

from radixray.engine.grammar.backend import GrammarBackend
from radixray.engine.grammar.spec import GrammarSpec


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


def test_a_matcher_out_of_step_with_the_output_is_rebuilt_over_it(backend):
    from model_fixtures import byte_bpe_tokenizer

    from radixray.engine.grammar.matcher import GrammarState
    tok = byte_bpe_tokenizer()
    state = GrammarState(backend.matcher, backend.compile(GrammarSpec("regex", "ab(cd)+")).result(60))
    ids = tok.encode("abcd", add_special_tokens=False)
    for t in ids:
        assert state.accept(t) is None
    state.sync(ids[:1])  # the output was rewritten to its first token: replay it
    assert state.accepted == 1
    rest = tok.encode("abcd", add_special_tokens=False)[1:]
    assert all(state.accept(t) is None for t in rest)
    assert state.accept(tok.eos_token_id).type == "stop"


def test_engines_that_cannot_apply_grammars_refuse_constrained_requests():
    from radixray.engine.inputs import Limits, build_requests
    limits = Limits(400, 64, 256, no_structured_output="the engine runs with grammar_backend='none'")
    with pytest.raises(ValueError, match="regex: structured output is not available here: .*none"):
        build_requests(None, [1, 2], {"regex": "a+"}, None, limits)
    build_requests(None, [1, 2], {}, None, limits)  # unconstrained requests still go


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
        for r in [r for r in s.queues.running if r.grammar is not None and len(r.output_ids) >= 4
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


# ---- served: the official openai client and native /generate ------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    config = tiny_config(tiny_llama_dir, free_port())
    config["engine"]["grammar_json_max_whitespace"] = 1
    with served(config) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def _schema_format(i: int, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                   "strict": True}}


def test_twenty_schemas_through_the_openai_client(client):
    finished = 0
    for i, schema in enumerate(SCHEMAS):
        got = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"give me json {i}"}],
            max_tokens=160, temperature=0.7, seed=i, response_format=_schema_format(i, schema))
        choice = got.choices[0]
        if choice.finish_reason != "stop":
            continue
        finished += 1
        jsonschema.validate(json.loads(choice.message.content), schema)
    assert finished >= 18


def test_json_object_streaming_and_n_choices(client):
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "an object"}], max_tokens=200,
        temperature=0.8, seed=5, n=3, stream=True,
        response_format=_schema_format(0, SCHEMAS[4]))
    texts, reasons = {}, {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert sorted(texts) == [0, 1, 2]
    assert len(set(texts.values())) > 1  # each choice has its own matcher and seed
    for i, text in texts.items():
        assert reasons[i] == "stop"
        jsonschema.validate(json.loads(text), SCHEMAS[4])
    got = client.completions.create(model="tiny", prompt="x", max_tokens=200, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    if got.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(got.choices[0].text), dict)


REGEXES = [r"[a-z]{3,6}", r"(yes|no), [0-9]{2}", r"\d{3}-\d{4}", r"(ab|ba)+c",
           r"[A-Z][a-z]{1,5} [A-Z][a-z]{1,5}", r"#[0-9a-f]{6}"]
EBNF = {  # grammar -> an equivalent regex to check the output with
    'root ::= "yes" | "no"': "yes|no",
    'root ::= digit digit ("." digit)?\ndigit ::= [0-9]': r"[0-9]{2}(\.[0-9])?",
    'root ::= "(" item ("," item)* ")"\nitem ::= [a-c]': r"\([a-c](,[a-c])*\)",
}


def test_regex_and_ebnf_through_native_generate(server):
    cases = [({"regex": r}, r) for r in REGEXES] + [({"ebnf": g}, r) for g, r in EBNF.items()]
    for i, (constraint, pattern) in enumerate(cases):
        r = httpx.post(f"{server}/generate", json={"text": f"prompt {i}", "sampling_params": {
            "max_new_tokens": 48, "temperature": 1.0, "seed": i, **constraint}}, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            assert re.fullmatch(pattern, out["text"]), (constraint, out["text"])
        else:  # only an unbounded repetition may run out of tokens
            assert "+" in pattern or "*" in pattern


def test_stop_string_ends_a_constrained_request(server):
    r = httpx.post(f"{server}/generate", json={"text": "x", "sampling_params": {
        "max_new_tokens": 40, "temperature": 0, "regex": "(ab)+STOP(cd)+", "stop": "STOP"}},
        timeout=120).json()
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": "STOP"}
    assert re.fullmatch("(ab)+", r["text"])


def test_bad_structured_output_is_a_400_naming_the_field(server, client):
    import openai
    with pytest.raises(openai.BadRequestError, match="json_schema: xgrammar cannot compile"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=8,
            response_format=_schema_format(0, {"type": "object", "properties": 7}))
    for sp, field in (({"regex": "(a"}, "regex"), ({"ebnf": "root ::= x"}, "ebnf"),
                      ({"regex": "a", "json_schema": {"type": "string"}}, "json_schema")):
        r = httpx.post(f"{server}/generate", json={"text": "x", "sampling_params": sp},
                       timeout=60)
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    # parses, compiles, and matches nothing: found once compiled (an error finish, 400)
    r = httpx.post(f"{server}/generate", json={"text": "x", "sampling_params": {
        "regex": r"[^\s\S]"}}, timeout=60)
    assert r.status_code == 400 and "regex: the grammar matches no text" in r.text, r.text


def test_metrics_count_constrained_requests_and_compiles(server):
    def counts() -> tuple[float, float]:
        text = httpx.get(f"{server}/metrics", timeout=60).text
        return (metric(text, "radixray:structured_output_requests_total"),
                metric(text, "radixray:grammar_compiles_total"))
    before = counts()
    for pattern in ("m(e|o)trics[0-9]", "counted[a-c]{2}"):  # new grammars: compiled here
        r = httpx.post(f"{server}/generate", timeout=120, json={
            "text": "x", "sampling_params": {"regex": pattern, "max_new_tokens": 16}})
        assert r.status_code == 200, r.text
    after = counts()
    assert after[0] - before[0] == 2 and after[1] - before[1] == 2, (before, after)
    text = httpx.get(f"{server}/metrics", timeout=60).text
    assert metric(text, "radixray:grammar_compile_seconds_total") > 0
    assert metric(text, "radixray:num_grammar_queue_reqs") == 0
