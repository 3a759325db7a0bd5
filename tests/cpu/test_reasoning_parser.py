"""The reasoning parsers (serve/reasoning.py): ``<think>...</think>`` split from the answer,
whole-text and streamed at every chunking, and the answer then read by a tool-call parser."""

import pytest
from test_tool_parsers import chunkings

from radixray.serve.reasoning import REASONING_PARSERS, reasoning_parser
from radixray.serve.tool_parsers import parser_class

CASES = [  # (parser, text, reasoning, content)
    ("deepseek-r1", "I should add.\n</think>\n\nIt is 4.", "I should add.", "It is 4."),
    ("deepseek-r1", "<think>\nplan\n</think>\n\nanswer", "plan", "answer"),
    ("deepseek-r1", "still thinking when max_tokens hit", "still thinking when max_tokens hit", ""),
    ("deepseek-r1", "</think>answer only", None, "answer only"),
    ("deepseek-r1", "a < b and </thin k> is not a tag", "a < b and </thin k> is not a tag", ""),
    ("deepseek-r1", "thinking </thi", "thinking </thi", ""),  # a partial tag at the end
    ("qwen3", "<think>\nLet me think.\n</think>\n\nHello!", "Let me think.", "Hello!"),
    ("qwen3", "Hello, no thinking here.", None, "Hello, no thinking here."),
    ("qwen3", "  <thin", None, "  <thin"),
    ("qwen3", "<think>\n\n</think>\n\nempty block", None, "empty block"),
    ("qwen3", "<think>unterminated", "unterminated", ""),
    ("qwen3", "<think>é中🙂 \"q\"</think>ünï", "é中🙂 \"q\"", "ünï"),
    ("qwen3", "", None, ""),
    ("qwen3-thinking", "step 1\nstep 2</think>done", "step 1\nstep 2", "done"),
]


def _stream(parser, text: str, sizes) -> tuple[str, str]:
    reasoning, content, i = [], [], 0
    for k in sizes:
        r, c = parser.feed(text[i:i + k])
        reasoning.append(r)
        content.append(c)
        i += k
    r, c = parser.flush()
    return "".join(reasoning) + r, "".join(content) + c


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_split_and_every_chunking_of_the_stream_agree(name, text, reasoning, content):
    assert reasoning_parser(name).split(text) == (reasoning, content)
    for sizes in chunkings(text, seed=len(text)):
        assert _stream(reasoning_parser(name), text, sizes) == (reasoning or "", content), sizes


def test_thinking_disabled_passes_everything_through_as_content():
    for name in REASONING_PARSERS:
        text = "<think>x</think>y"
        assert reasoning_parser(name, enable_thinking=False).split(text) == (None, text)


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="deepseek-r1.*qwen3"):
        reasoning_parser("nope")


def test_a_tool_call_after_the_reasoning_block():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    text = ('<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    reasoning, content = reasoning_parser("qwen3").split(text)
    assert reasoning == "The user wants the weather."
    parsed = parser_class("hermes")(tools).parse(content)
    assert parsed.text == "Let me check."
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", '{"city": "Paris"}')]
    # streamed: reasoning deltas, then content deltas fed on to the tool-call parser
    reasoning_p, tool_p = reasoning_parser("qwen3"), parser_class("hermes")(tools)
    texts, args, got_reasoning = [], [], []
    for i in range(len(text)):
        r, c = reasoning_p.feed(text[i])
        got_reasoning.append(r)
        d = tool_p.feed(c)
        texts.append(d.text)
        args += [x.arguments for x in d.calls]
    r, c = reasoning_p.flush()
    for d in (tool_p.feed(c), tool_p.flush()):
        texts.append(d.text)
        args += [x.arguments for x in d.calls]
    assert "".join(got_reasoning) + r == reasoning
    assert "".join(texts) == "Let me check." and "".join(args) == '{"city": "Paris"}'


def test_constraints_apply_after_the_reasoning_block():
    from test_tool_parsers import accepts, compile_tag
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
    forced = parser_class("hermes").forced_call(tools, "f")
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    qwen3 = compile_tag(reasoning_parser("qwen3").after_reasoning(forced))
    assert accepts(qwen3, "<think>\nany text, even {broken\n</think>\n\n" + call)
    assert not accepts(qwen3, call)  # the model opens the block itself
    assert not accepts(qwen3, "<think>x</think>\n\nchat first " + call)
    r1 = compile_tag(reasoning_parser("deepseek-r1").after_reasoning(forced))
    assert accepts(r1, "the template opened the block</think>" + call)
    schema = compile_tag(reasoning_parser("deepseek-r1").after_reasoning(
        {"json_schema": '{"type": "object", "properties": {"a": {"type": "boolean"}}}',
         "max_new_tokens": 9}))
    assert accepts(schema, 'hmm</think>\n\n{"a": true}')
    assert not accepts(schema, 'hmm</think>\n\n{"a": 1}')
    # thinking off, or nothing to constrain: the params as they were
    assert reasoning_parser("qwen3", enable_thinking=False).after_reasoning(forced) == forced
    assert reasoning_parser("qwen3").after_reasoning({"max_new_tokens": 3}) == {"max_new_tokens": 3}
