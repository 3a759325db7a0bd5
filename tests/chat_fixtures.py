"""A tool-calling chat template (hermes ``<tool_call>`` blocks, Qwen-style ``<think>`` with
``enable_thinking``) for the tiny models, written for these tests, and tools to call."""

from __future__ import annotations

import os

TOOLS_CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
You may call functions. Their signatures:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each call, answer with:
<tool_call>
{"name": <name>, "arguments": <arguments object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' and loop.first %}
{%- elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content or '' }}
{%- for c in m.tool_calls or [] %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {
        "tz": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
        "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]


def with_tools_template(model_dir: str, folder: str) -> str:
    """A copy of ``model_dir`` (files linked) whose tokenizer has TOOLS_CHAT_TEMPLATE."""
    from transformers import AutoTokenizer
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(model_dir):
        if not name.startswith(("tokenizer", "special_tokens", "chat_template")):
            os.symlink(os.path.join(model_dir, name), os.path.join(folder, name))
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = TOOLS_CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return folder
