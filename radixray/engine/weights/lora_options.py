"""LoRA options: ``lora_paths`` entries parsed, and the engine options LoRA does not run with.

Imports no torch: ``EngineConfig`` calls :func:`check_lora` on construction, and the cluster
reads the config schema without torch.
"""

from __future__ import annotations

import os
import re

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/]*$")
DEFAULT_MAX_LORA_RANK = 16  # the slots' rank when neither max_lora_rank nor lora_paths say


def parse_lora_path(entry: str) -> tuple[str, str]:
    """``'name=path'`` -> (name, path); a bare path names itself (SGLang's form). ValueError
    naming ``lora_paths`` for an empty part or a name the ``model`` field cannot carry."""
    name, sep, path = entry.partition("=")
    if not sep:
        name = path = entry
    name, path = name.strip(), path.strip()
    if not name or not path:
        raise ValueError(f"lora_paths: {entry!r} must be 'name=path' or a path")
    check_adapter_name(name, "lora_paths")
    return name, os.path.expanduser(path)


def check_adapter_name(name: str, field: str) -> None:
    """An adapter name is what a request's ``model`` (``base:adapter``) or ``lora_path``
    names: letters, digits and ``._-/``, no ``:`` or ``=``."""
    if not isinstance(name, str) or not ADAPTER_NAME.match(name):
        raise ValueError(f"{field}: adapter name {name!r} must be letters, digits and ._-/ "
                         "(no ':' or '=')")


def check_lora(config) -> None:
    """ValueError naming the field when a LoRA config cannot run: unparsable or repeated
    ``lora_paths`` names, or options whose forward passes do not carry per-request adapters
    (tensor or expert parallelism, speculative verify steps, a prefill-decode pair,
    deterministic mode's batch-invariant kernels). Nothing to check without LoRA."""
    if not (config.enable_lora or config.lora_paths):
        return
    names = [parse_lora_path(e)[0] for e in config.lora_paths or ()]
    if len(set(names)) != len(names):
        raise ValueError(f"lora_paths: adapter names must be unique, got {names}")
    refused = {"tp_size": config.tp_size > 1, "ep_size": config.ep_size > 1,
               "speculative_algorithm": config.speculative_algorithm is not None,
               "disaggregation_mode": config.disaggregation_mode is not None,
               "deterministic": config.deterministic}
    for name, on in refused.items():
        if on:
            raise ValueError(f"LoRA (enable_lora / lora_paths) does not run with {name}="
                             f"{getattr(config, name)!r} yet: leave one of them unset")
