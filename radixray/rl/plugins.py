"""User code plugged into a GRPO job by import path (``package.module:attribute``).

A config names a task, a reward function or a rollout function either by a registered
name or by where to import it from, as slime's ``--rollout-function-path`` and
``--custom-rm-path`` do. Both ``pkg.mod:attr`` and ``pkg.mod.attr`` are accepted; the
module must be importable where the job runs (under ``ray job submit --working-dir .``
the working directory is on the path of the driver).
"""

from __future__ import annotations

import importlib


def is_import_path(text: str) -> bool:
    """Whether ``text`` names an object by module (``a.b:c`` or ``a.b.c``), not a registry name."""
    return ":" in text or "." in text


def load_object(path: str, what: str):
    """The object at ``path``; ValueError saying what was looked for (``what``) and why
    it is not there."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what} {path!r} is not an import path: write 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r} ({exc}); "
                         f"is it on PYTHONPATH (or in the job's working directory)?") from None
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ValueError(f"{what} {path!r}: module {module_name!r} has no {attr!r}") from None
    return obj


def load_callable(path: str, what: str):
    """:func:`load_object`, checked to be callable."""
    obj = load_object(path, what)
    if not callable(obj):
        raise ValueError(f"{what} {path!r} is a {type(obj).__name__}, not a function")
    return obj
