"""Tool calling and reasoning in /v1/chat/completions over a scripted model: the Frontend
and chat handlers are real, the dispatcher stands in for a worker and answers each request
with a given text (tokenized by the real tokenizer, in pieces). So the output side (the
split into reasoning, content and calls, streamed and whole, finish reasons) and the
request side (templates, grammar params, refusals) are checked exactly; the served path
with the official openai client and a real engine is test_chat_tools_api.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from chat_fixtures import TIME, TOOLS, TOOLS_CHAT_TEMPLATE, WEATHER
from model_fixtures import byte_bpe_tokenizer

from radixray.cluster.messages import WorkerInfo
from radixray.engine.messages import MetaInfo, RequestUpdate
from radixray.engine.request import FinishReason
from radixray.serve.api_error import ApiError
from radixray.serve.chat_parsers import ChatFeatures
from radixray.serve.chat_serving import chat_completion
from radixray.serve.frontend import Frontend
from radixray.serve.protocol import ChatCompletionRequest


class ScriptedDispatcher:
    """Answers every request with ``text`` in ``pieces`` updates; keeps the requests."""

    def __init__(self, tokenizer, text: str, pieces: int = 7, reason: str = "stop"):
        self.ids = tokenizer.encode(text, add_special_tokens=False)
        self.pieces, self.reason, self.requests = pieces, reason, []

    async def run(self, requests, route_text, session_id):
        self.requests.extend(requests)
        return [self._stream(r.rid) for r in requests]

    async def _stream(self, rid):
        step = max(1, -(-len(self.ids) // self.pieces))
        chunks = [self.ids[i:i + step] for i in range(0, len(self.ids), step)] or [[]]
        for i, chunk in enumerate(chunks):
            meta = None
            if i == len(chunks) - 1:
                meta = MetaInfo(rid, FinishReason(self.reason), 3, len(self.ids), 0, None,
                                None, None, 0)
            yield RequestUpdate(rid, chunk, meta=meta)
            await asyncio.sleep(0)


def _tokenizer(template: str | None = TOOLS_CHAT_TEMPLATE):
    tok = byte_bpe_tokenizer()
    tok = type(tok)(tokenizer_object=tok.backend_tokenizer, eos_token="<|endoftext|>",
                    clean_up_tokenization_spaces=False)
    tok.chat_template = template
    return tok


def _frontend(text: str, template: str | None = TOOLS_CHAT_TEMPLATE, pieces: int = 7,
              **features) -> Frontend:
    tok = _tokenizer(template)
    info = WorkerInfo("w0", "fake", context_len=4096, vocab_size=len(tok),
                      max_total_tokens=4096, draining=False)
    chat = ChatFeatures.detect(tok, "qwen3", **features)
    return Frontend(tok, info, "fake", ScriptedDispatcher(tok, text, pieces), chat=chat)


def _ask(fe: Frontend, **body):
    body.setdefault("messages", [{"role": "user", "content": "weather in Paris?"}])
    req = ChatCompletionRequest(**body)
    return asyncio.run(chat_completion(fe, req))


def _stream(fe: Frontend, **body) -> list[dict]:
    async def collect():
        lines = await chat_completion(fe, ChatCompletionRequest(stream=True, **body))
        return [json.loads(line[6:]) for line in [x async for x in lines]
                if line.startswith("data: {")]
    body.setdefault("messages", [{"role": "user", "content": "weather in Paris?"}])
    return asyncio.run(collect())


def _assemble(chunks: list[dict]) -> dict:
    """A streamed choice put together the way the OpenAI client does."""
    msg = {"content": "", "reasoning_content": "", "tool_calls": {}, "finish_reason": None}
    for ch in chunks:
        for c in ch["choices"]:
            d = c["delta"]
            msg["content"] += d.get("content") or ""
            msg["reasoning_content"] += d.get("reasoning_content") or ""
            for tc in d.get("tool_calls") or []:
                call = msg["tool_calls"].setdefault(tc["index"], {"id": None, "name": "",
                                                                  "arguments": ""})
                assert ("id" in tc) == (call["id"] is None), "the id comes once, first"
                call["id"] = call["id"] or tc["id"]
                call["name"] += tc["function"].get("name") or ""
                call["arguments"] += tc["function"].get("arguments") or ""
            msg["finish_reason"] = c["finish_reason"] or msg["finish_reason"]
    return msg


TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
             '"Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
             '"arguments": {"tz": "CET"}}\n</tool_call>')


@pytest.mark.parametrize("pieces", [1, 5, 40])
def test_calls_in_the_output_become_tool_calls_whole_and_streamed(pieces):
    fe = _frontend(TWO_CALLS, pieces=pieces)
    out = _ask(fe, tools=TOOLS)
    choice = out["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and msg["content"] == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg["tool_calls"]] == [("get_weather", {"city": "Paris", "unit": "celsius"}),
                                            ("get_time", {"tz": "CET"})]
    assert all(c["id"].startswith("call_") and c["type"] == "function"
               for c in msg["tool_calls"])
    streamed = _assemble(_stream(_frontend(TWO_CALLS, pieces=pieces), tools=TOOLS))
    assert streamed["finish_reason"] == "tool_calls" and streamed["content"] == "Let me check."
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"].values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]


def test_broken_and_unknown_calls_stay_content_and_finish_as_stop():
    text = 'Hmm <tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call> ok'
    out = _ask(_frontend(text), tools=TOOLS)["choices"][0]
    assert out["finish_reason"] == "stop" and "tool_calls" not in out["message"]
    assert out["message"]["content"] == text
    streamed = _assemble(_stream(_frontend(text), tools=TOOLS))
    assert streamed["content"] == text and not streamed["tool_calls"]
    # a call cut short by the length limit keeps the valid part of its arguments
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    fe = _frontend(cut)
    fe.dispatcher.reason = "length"
    got = _ask(fe, tools=TOOLS)["choices"][0]
    assert got["finish_reason"] == "length"
    assert json.loads(got["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Par"}


def test_without_tools_the_same_text_is_plain_content():
    out = _ask(_frontend(TWO_CALLS))["choices"][0]
    assert out["message"] == {"role": "assistant", "content": TWO_CALLS,
                              "reasoning_content": None}  # the template has a <think> block
    assert out["finish_reason"] == "stop"
    none = _ask(_frontend(TWO_CALLS), tools=TOOLS, tool_choice="none")["choices"][0]
    assert none["message"]["content"] == TWO_CALLS


def _after_think(sp) -> dict:
    """The call's structural-tag format of ``sp``, which follows a free <think> block (the
    template reasons)."""
    fmt = json.loads(sp.structural_tag)["format"]
    assert fmt["type"] == "sequence" and fmt["elements"][0]["end"][-1] == "</think>"
    return fmt["elements"][1]


def test_tool_choice_sets_the_grammar_and_the_template_gets_the_tools():
    fe = _frontend(TWO_CALLS)
    _ask(fe, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    _ask(fe, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    _ask(fe, tools=TOOLS)  # auto: constrained from <tool_call> on
    _ask(fe, tools=TOOLS, tool_choice="none")
    named, required, auto, none = (r.sampling_params for r in fe.dispatcher.requests)
    tag = _after_think(named)
    assert tag["begin"].startswith('<tool_call>\n{"name": "get_time"')
    assert tag["content"]["json_schema"] == TIME["function"]["parameters"]
    req_fmt = _after_think(required)
    assert req_fmt["stop_after_first"] is True and req_fmt["at_least_one"] is True
    assert _after_think(auto)["triggers"] == ["<tool_call>"]
    assert none.structural_tag is None
    prompts = [fe.tokenizer.decode(r.input_ids) for r in fe.dispatcher.requests]
    assert all('"name": "get_weather"' in p for p in prompts[:3])
    assert "<tools>" not in prompts[3]


def test_history_with_calls_and_results_goes_through_the_template():
    fe = _frontend("It is 18 degrees.")
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function", "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    out = _ask(fe, messages=messages, tools=TOOLS)["choices"][0]
    assert out["message"]["content"] == "It is 18 degrees." and out["finish_reason"] == "stop"
    prompt = fe.tokenizer.decode(fe.dispatcher.requests[0].input_ids)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}\n</tool_call>') in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope' is not among the tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot be combined"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "may not set"),
])
def test_bad_tool_requests_are_400_naming_the_field(body, param, words):
    from pydantic import ValidationError
    fe = _frontend("x")
    with pytest.raises((ApiError, ValidationError)) as err:
        _ask(fe, **body)
    text = str(err.value)
    if isinstance(err.value, ApiError):
        assert err.value.param == param and words in err.value.message
    else:
        assert param in text and words in text
    assert not fe.dispatcher.requests


def test_a_template_without_tools_is_a_400_unless_the_generic_prompt_is_on():
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    with pytest.raises(ApiError) as err:
        _ask(_frontend(TWO_CALLS, template=plain), tools=TOOLS)
    assert err.value.status == 400 and err.value.param == "tools"
    assert "--generic-tool-prompt" in err.value.message
    fe = _frontend(TWO_CALLS, template=plain, generic_tool_prompt=True)
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                   "name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    out = _ask(fe, messages=history, tools=TOOLS)["choices"][0]
    assert out["finish_reason"] == "tool_calls" and len(out["message"]["tool_calls"]) == 2
    prompt = fe.tokenizer.decode(fe.dispatcher.requests[0].input_ids)
    assert prompt.startswith("system: You may call functions") and '"get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>' in prompt
    assert "user: <tool_response>\nnoon\n</tool_response>" in prompt
    off = _frontend(TWO_CALLS, tool_call_parser="none")
    with pytest.raises(ApiError, match="tool_call_parser: none"):
        _ask(off, tools=TOOLS)


REASONED = ("<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{\"name\": "
            "\"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"unit\": \"celsius\"}}\n"
            "</tool_call>")


@pytest.mark.parametrize("pieces", [1, 9, 60])
def test_reasoning_is_split_from_the_answer_and_calls_after_it_parse(pieces):
    fe = _frontend(REASONED, pieces=pieces)
    assert fe.chat.reasoning_parser == "qwen3"  # the template writes <think>
    msg = _ask(fe, tools=TOOLS)["choices"][0]["message"]
    assert msg["reasoning_content"] == "The user wants weather." and msg["content"] is None
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
    streamed = _assemble(_stream(_frontend(REASONED, pieces=pieces), tools=TOOLS))
    assert streamed["reasoning_content"] == "The user wants weather."
    assert streamed["content"] == "" and streamed["finish_reason"] == "tool_calls"
    kept = _ask(_frontend(REASONED), separate_reasoning=False)["choices"][0]["message"]
    assert kept == {"role": "assistant", "content": REASONED}


def test_chat_template_kwargs_reach_the_template_and_move_the_grammar():
    fe = _frontend("Paris.")
    _ask(fe, chat_template_kwargs={"enable_thinking": False})
    _ask(fe, tools=TOOLS, tool_choice="required")
    off, forced = fe.dispatcher.requests
    assert fe.tokenizer.decode(off.input_ids).endswith("<think>\n\n</think>\n\n")
    fmt = json.loads(forced.sampling_params.structural_tag)["format"]  # reasoning, then call
    assert fmt["type"] == "sequence" and fmt["elements"][0]["begin"] == "<think>"
    msg = _ask(_frontend("<think>x</think>Paris."),
               chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    assert msg["content"] == "<think>x</think>Paris." and msg["reasoning_content"] is None
