"""Tool-call parsers by name (``--tool-call-parser``), and the default for a model family.

:func:`parser_class` maps a name to its :class:`ToolCallParser` subclass; the formats are
imported lazily, on first use. :func:`parser_for_model` picks a name from the model's Hugging
Face config (its ``model_type``) and its chat template: the template decides when it shows a
call syntax (``<tool_call>`` -> hermes, ``[TOOL_CALLS]`` -> mistral, Llama's
``"parameters": `` JSON calls or ``<|python_tag|>`` -> llama3), else the family does.
"""

from __future__ import annotations

import importlib

from radixray.serve.tool_parsers.base import ToolCallParser

# name -> (module, class)
PARSERS = {
    "hermes": ("radixray.serve.tool_parsers.hermes", "HermesParser"),
    "llama3": ("radixray.serve.tool_parsers.llama3", "Llama3JsonParser"),
    "mistral": ("radixray.serve.tool_parsers.mistral", "MistralParser"),
}
# model_type (HF config) -> parser, when the chat template does not show the syntax
_FAMILIES = {
    "qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
    "llama": "llama3", "mistral": "mistral", "mixtral": "mistral",
}
# chat-template text -> parser, checked in this order
_TEMPLATE_SIGNS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
                   ("<|python_tag|>", "llama3"), ('"parameters": ', "llama3"))


def parser_class(name: str) -> type[ToolCallParser]:
    """The parser class called ``name``; ValueError listing the known names otherwise."""
    if name not in PARSERS:
        raise ValueError(f"tool-call parser {name!r} is not known; known: {sorted(PARSERS)}")
    module, cls = PARSERS[name]
    return getattr(importlib.import_module(module), cls)


def parser_for_model(hf_config=None, chat_template: str | None = None) -> str | None:
    """The parser name for a model: ``hf_config`` is its Hugging Face config (an object or a
    dict with ``model_type``) or the model_type itself; None when neither the template nor
    the family says."""
    for sign, name in _TEMPLATE_SIGNS:
        if chat_template and sign in chat_template:
            return name
    if isinstance(hf_config, str):
        model_type = hf_config
    elif isinstance(hf_config, dict):
        model_type = hf_config.get("model_type")
    else:
        model_type = getattr(hf_config, "model_type", None)
    return _FAMILIES.get(model_type)
