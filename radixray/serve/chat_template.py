"""A chat request's messages and tools rendered into the prompt text by the model's template.

Two ways to show tools to a model:

- ``template``: the chat template takes them (its text uses the ``tools`` variable, as the
  Qwen, Llama 3.1+ and Mistral templates do). Messages go to it in the shape Hugging Face
  templates read: an assistant's ``tool_calls`` with their ``arguments`` as a dict (parsed
  from OpenAI's JSON text when it is an object), ``tool`` messages with ``tool_call_id``.
- ``generic``: the template knows nothing of tools (SmolLM2's, for one) and the server was
  told to describe them itself (``server.generic_tool_prompt``): a system-message section
  lists the tools' schemas and asks for hermes ``<tool_call>`` blocks; the history's calls
  are written as such blocks and tool results as ``<tool_response>`` user turns, so any
  template can render them. The hermes parser reads the answers.

A template that does not take tools and no generic prompt: a request with tools is refused
(400 naming ``tools``) by the caller (serve/chat_parsers.py), never rendered without them.
"""

from __future__ import annotations

import json

from radixray.serve.api_error import ApiError

# apply_chat_template's own parameters: chat_template_kwargs may not set them
_RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})

GENERIC_TOOL_PROMPT = (
    "You may call functions to help with the request. The functions, as JSON schemas:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call one, answer with a block like this for each call, and nothing else:\n"
    "<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}}\n"
    "</tool_call>\n"
    "A call's result comes back in a <tool_response> block.")


def template_text(tokenizer) -> str | None:
    """The tokenizer's chat template as text (a dict of named templates: all of them)."""
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):
        return "\n".join(str(t) for t in tpl.values())
    return tpl


def template_takes_tools(tokenizer) -> bool:
    """Whether the chat template reads the ``tools`` variable."""
    text = template_text(tokenizer)
    return bool(text) and "tools" in text


def _arguments(text: str):
    """OpenAI's arguments text as a template wants it: the object, or the text as sent."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _hermes_block(name: str, arguments: str) -> str:
    args = _arguments(arguments)
    body = json.dumps({"name": name, "arguments": args if isinstance(args, dict) else {}},
                      ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def template_messages(messages) -> list[dict]:
    """Request messages (protocol.ChatMessage) in the shape Hugging Face templates read."""
    out = []
    for m in messages:
        d: dict = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
        out.append(d)
    return out


def generic_messages(messages, tools: list[dict] | None) -> list[dict]:
    """Request messages as plain role/content turns, tools described in the system turn,
    calls and results written as hermes blocks (see the module docstring)."""
    out: list[dict] = []
    for m in messages:
        if m.role == "tool":
            out.append({"role": "user", "content":
                        f"<tool_response>\n{m.text()}\n</tool_response>"})
            continue
        text = m.text()
        if m.tool_calls:
            blocks = [_hermes_block(c.function.name, c.function.arguments) for c in m.tool_calls]
            text = "\n".join(([text] if text else []) + blocks)
        out.append({"role": m.role, "content": text})
    if tools:
        section = GENERIC_TOOL_PROMPT.format(tools="\n".join(
            json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{section}"
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None,
           template_kwargs: dict | None = None) -> str:
    """The prompt text of ``messages`` (template-shaped dicts) with the generation prompt;
    ``tools`` go to the template as its ``tools``; ``template_kwargs`` (the request's
    ``chat_template_kwargs``) become template variables. ApiError 400 when there is no
    template, a kwarg would override the call's own arguments, or the template rejects the
    messages."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ApiError(400, "this model has no chat template; use /v1/completions",
                       param="messages")
    kwargs = dict(template_kwargs or {})
    reserved = sorted(_RESERVED_KWARGS & kwargs.keys())
    if reserved:
        raise ApiError(400, f"chat_template_kwargs may not set {reserved}: they are the "
                       f"request's own (messages, tools, ...)", param="chat_template_kwargs")
    try:
        return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                             add_generation_prompt=True, **kwargs)
    except Exception as exc:  # template errors come from user-supplied message shapes
        raise ApiError(400, f"the chat template rejected the messages: {exc}",
                       param="messages") from None
