"""Which tool-call and reasoning parsers a served model gets, and what one chat request
asks of them.

:class:`ChatFeatures` is decided once per ingress replica from the server options
(``server.tool_call_parser``, ``server.reasoning_parser``, ``server.generic_tool_prompt``),
the model's chat template and its Hugging Face config:

- tool calls: ``auto`` picks the parser the template's call syntax or the model family
  shows (serve/tool_parsers/__init__.py); ``none`` refuses tools. A template that does not
  take tools refuses them too, unless the generic tool prompt is on (then hermes blocks,
  serve/chat_template.py). Refused: a 400 naming ``tools`` that says why and what to set.
- reasoning: ``auto`` takes the ``<think>`` family when the template writes ``<think>``:
  ``qwen3-thinking`` (or ``deepseek-r1`` for a DeepSeek model) when the generation prompt
  already opens the block, else ``qwen3``; ``none`` leaves reasoning in the content.

:func:`plan` turns one request's ``tools``, ``tool_choice``, ``parallel_tool_calls``,
``separate_reasoning`` and ``chat_template_kwargs`` into a :class:`ChatPlan`. The grammar
choice: ``required`` and a named function are forced (a structural tag of the parser's
syntax, arguments under the tool's schema); ``auto`` is constrained from the call's opening
marker on (free text until the model opens a call, then a valid call), unless the request
also has a ``response_format``, which then governs alone. With a reasoning parser, the
constraint starts after the reasoning block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixray.serve.api_error import ApiError
from radixray.serve.chat_template import (
    generic_messages,
    template_messages,
    template_takes_tools,
    template_text,
)
from radixray.serve.reasoning import reasoning_parser
from radixray.serve.tool_parsers import parser_class, parser_for_model
from radixray.serve.tool_parsers.base import ToolCallParser


@dataclass(frozen=True)
class ChatFeatures:
    """The served model's tool and reasoning handling (see the module docstring)."""

    tool_parser: str | None = None  # None: tools are refused, for ``tools_refused``
    tool_format: str = "template"  # "template" | "generic" (serve/chat_template.py)
    tools_refused: str | None = "this server does not parse tool calls"
    reasoning_parser: str | None = None

    @classmethod
    def detect(cls, tokenizer, hf_config=None, tool_call_parser: str = "auto",
               reasoning: str = "auto", generic_tool_prompt: bool = False) -> ChatFeatures:
        template = template_text(tokenizer)
        takes_tools = template_takes_tools(tokenizer)
        parser, fmt, refused = None, "template", None
        if tool_call_parser == "none":
            refused = ("this server does not parse tool calls (server.tool_call_parser: none); "
                       "start it with --tool-call-parser auto, hermes, llama3 or mistral")
        elif not takes_tools and generic_tool_prompt:
            parser, fmt = "hermes", "generic"
        elif not takes_tools:
            refused = ("this model's chat template does not take tools; start the server with "
                       "--generic-tool-prompt (server.generic_tool_prompt: true) to describe "
                       "them in a system message")
        else:
            parser = (parser_for_model(hf_config, template) if tool_call_parser == "auto"
                      else tool_call_parser)
            if parser is None:
                refused = ("no tool-call parser is known for this model; start the server with "
                           "--tool-call-parser hermes, llama3 or mistral")
        return cls(parser, fmt, refused, _reasoning_for(tokenizer, hf_config, template,
                                                        reasoning))

    def describe(self) -> str:
        """One start-up log line."""
        tools = (f"tool calls: {self.tool_parser} ({self.tool_format} prompt)"
                 if self.tool_parser else f"tool calls: refused ({self.tools_refused})")
        return f"{tools}; reasoning parser: {self.reasoning_parser or 'none'}"


def _reasoning_for(tokenizer, hf_config, template: str | None, name: str) -> str | None:
    if name != "auto":
        return None if name == "none" else name
    if not template or "<think>" not in template:
        return None
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                               tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that needs more than this: no guess
        return None
    if not prompt.rstrip().endswith("<think>"):
        return "qwen3"
    model_type = getattr(hf_config, "model_type", "") or ""
    return "deepseek-r1" if model_type.startswith("deepseek") else "qwen3-thinking"


@dataclass
class ChatPlan:
    """What one chat request needs: the template's messages and tools, the parsers that
    read its output, and the constraint merged into every choice's sampling params."""

    messages: list[dict]
    tools: list[dict] | None = None  # the request's tools (None with tool_choice none)
    template_tools: list[dict] | None = None  # given to the template (None: generic prompt)
    parser: type[ToolCallParser] | None = None  # reads calls out of the output
    reasoning: str | None = None  # reasoning parser name, when reasoning is separated
    enable_thinking: bool = True
    constraint: dict = field(default_factory=dict)

    def choice_params(self, features: ChatFeatures, sp: dict) -> dict:
        """``sp`` with the request's tool constraint, moved past the reasoning block when
        the model reasons first."""
        if not self.constraint:
            return sp
        sp = {**sp, **self.constraint}
        if features.reasoning_parser:
            sp = reasoning_parser(features.reasoning_parser,
                                  self.enable_thinking).after_reasoning(sp)
        return sp


def plan(features: ChatFeatures, req) -> ChatPlan:
    """The :class:`ChatPlan` of a ChatCompletionRequest; ApiError 400 naming the field for
    tools this server refuses, a ``tool_choice`` without tools or naming an unknown function,
    and a forced call combined with ``response_format``."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice or ("auto" if tools else "none")
    kwargs = req.chat_template_kwargs or {}
    thinking = bool(kwargs.get("enable_thinking", True))
    out = ChatPlan(messages=[], enable_thinking=thinking,
                   reasoning=features.reasoning_parser if req.separate_reasoning else None)
    if choice != "none":
        if not tools:
            raise ApiError(400, "tool_choice asks for a tool call but the request has no tools",
                           param="tool_choice")
        if features.tool_parser is None:
            raise ApiError(400, f"tools are not supported: {features.tools_refused}",
                           param="tools")
        out.tools, out.parser = tools, parser_class(features.tool_parser)
        out.constraint = _constraint(out.parser, tools, choice, req)
    generic = features.tool_format == "generic"
    out.messages = (generic_messages(req.messages, out.tools) if generic
                    else template_messages(req.messages))
    out.template_tools = None if generic else out.tools  # generic: in the system turn
    return out


def _constraint(parser: type[ToolCallParser], tools: list[dict], choice, req) -> dict:
    formatted = req.response_format is not None and req.response_format.type != "text"
    if choice == "auto":
        return {} if formatted else parser.triggered_call(tools, req.parallel_tool_calls)
    if formatted:
        raise ApiError(400, "response_format cannot be combined with tool_choice "
                       f"{choice if isinstance(choice, str) else 'naming a function'}: the "
                       "output is the tool call", param="response_format")
    name = None if choice == "required" else choice.function.name
    try:
        return parser.forced_call(tools, name, req.parallel_tool_calls)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="tool_choice") from None
