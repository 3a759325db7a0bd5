"""Tool calling through the served app with the official openai client, on a tiny random
Qwen3 whose chat template takes tools (tests/chat_fixtures.py): a forced call (a named
function, or ``required``) always parses and validates against the tool's schema, whole and
streamed (assembled by the client's own stream state), a history with calls and results
renders, ``auto`` runs, refusals are 400s naming the field, and no KV slot is lost.
The output split itself, over scripted text, is test_chat_tools.py."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from chat_fixtures import TIME, TOOLS, WEATHER, with_tools_template
from schema_fixtures import SCHEMAS, obj
from serving_helpers import free_port, served, tiny_config

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]


@pytest.fixture(scope="module")
def server(tiny_qwen3_dir, tmp_path_factory):
    model = with_tools_template(tiny_qwen3_dir, str(tmp_path_factory.mktemp("tools-model")))
    with served(tiny_config(model, free_port())) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def _check_calls(calls, allowed: list[dict]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in allowed}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in schemas
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("choice, allowed", [
    ({"type": "function", "function": {"name": "get_weather"}}, [WEATHER]),
    ({"type": "function", "function": {"name": "get_time"}}, [TIME]),
    ("required", TOOLS),
])
def test_a_forced_call_parses_and_validates_whole_and_streamed(client, choice, allowed):
    from openai.lib.streaming.chat import ChatCompletionStreamState
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=200,
              temperature=0, parallel_tool_calls=False, extra_body=NO_THINKING)
    out = client.chat.completions.create(**kw)
    choice0 = out.choices[0]
    assert choice0.finish_reason == "tool_calls", choice0
    _check_calls(choice0.message.tool_calls, allowed)
    assert len(choice0.message.tool_calls) == 1 and not choice0.message.content
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
    streamed = state.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in choice0.message.tool_calls]


# Tool parameters are objects: the one array schema is wrapped in one.
TOOL_SCHEMAS = [s if s["type"] == "object" else obj({"values": s}) for s in SCHEMAS]


def test_twenty_schemas_as_named_calls_all_parse_and_validate(client):
    for i, schema in enumerate(TOOL_SCHEMAS):
        tool = {"type": "function", "function": {"name": f"tool_{i}", "parameters": schema}}
        out = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"call {i}"}], tools=[tool],
            tool_choice={"type": "function", "function": {"name": f"tool_{i}"}},
            max_tokens=300, temperature=0.7, seed=i, extra_body=NO_THINKING)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", (i, choice)
        _check_calls(choice.message.tool_calls, [tool])


def _round_trip(client, stream: bool) -> tuple[list, str]:
    """A forced call, its result as a tool message, then the model's answer with tool_choice
    none; returns (the calls, the answer)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    def ask(messages, **kw):
        kw = dict(model="tiny", messages=messages, tools=[TIME], temperature=0,
                  extra_body=NO_THINKING, **kw)
        if not stream:
            return client.chat.completions.create(**kw).choices[0]
        state = ChatCompletionStreamState()
        for chunk in client.chat.completions.create(stream=True, **kw):
            state.handle_chunk(chunk)
        # the snapshot, not get_final_completion(), which raises on a length finish
        return state.current_completion_snapshot.choices[0]
    first = ask(ASK, tool_choice="required", parallel_tool_calls=False, max_tokens=150)
    assert first.finish_reason == "tool_calls"
    calls = first.message.tool_calls
    _check_calls(calls, [TIME])
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                      "arguments": c.function.arguments}}
        for c in calls]}] + [{"role": "tool", "tool_call_id": c.id, "content": "12:00"}
                             for c in calls]
    final = ask(history, tool_choice="none", max_tokens=8)
    assert final.finish_reason in ("stop", "length") and not final.message.tool_calls
    return [(c.function.name, c.function.arguments) for c in calls], final.message.content


def test_a_tool_round_trip_whole_and_streamed_gives_the_same_calls_and_answer(client):
    assert _round_trip(client, stream=False) == _round_trip(client, stream=True)


def test_parallel_required_calls_are_each_valid(client):
    out = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
        temperature=0.7, seed=3, n=2, extra_body=NO_THINKING)
    for choice in out.choices:
        if choice.finish_reason == "tool_calls":
            _check_calls(choice.message.tool_calls, TOOLS)
        else:  # a random model may keep adding calls until the length limit cuts one
            assert choice.finish_reason == "length"
            *whole, cut = choice.message.tool_calls
            whole and _check_calls(whole, TOOLS)
            assert cut.function.name in ("get_weather", "get_time")


def test_a_history_with_calls_and_results_then_auto(client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    out = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                         max_tokens=12, temperature=0, extra_body=NO_THINKING)
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.message.tool_calls:  # auto: a call the model opens is a valid one
        _check_calls(choice.message.tool_calls, TOOLS)
    else:
        assert isinstance(choice.message.content, str)
    assert out.usage.prompt_tokens > 100  # the tools and the call went into the prompt


def test_tool_refusals_are_400s_naming_the_field(client, server):
    from openai import BadRequestError
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, max_tokens=4,
            tool_choice={"type": "function", "function": {"name": "book_flight"}})
    assert err.value.body["param"] == "tool_choice" and "book_flight" in err.value.body["message"]
    bad = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": ASK, "max_tokens": 4,
        "tools": [{"type": "function", "function": {"name": "no spaces allowed"}}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("tools")
    still = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=3)
    assert still.usage.completion_tokens >= 1


def test_no_kv_slot_is_lost(server, client):
    kv = httpx.get(f"{server}/debug/kv_conservation", timeout=60).json()["worker-0"]
    assert kv["running"] == 0 and kv["waiting"] == 0 and kv["free"] + kv["cached"] == kv["pool"]
