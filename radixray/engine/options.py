"""Options declared once: a dataclass field with its description and bounds, from which the
dataclass validates itself, the serve YAML schema is derived (``cluster/config.py``) and the
command-line flags are built (:func:`add_flags`).

An option is ``name: type = option(default, "what it does", ge=..., choices=...)``. The
bounds are ``ge``/``gt``/``le``/``lt`` (numbers), ``choices`` (a closed set) and
``pattern`` (a regular expression a string must match whole). An option typed
``tuple[str, ...]`` is a list (a flag taking several values, a YAML list).
"""

from __future__ import annotations

import argparse
import dataclasses
import operator
import re
import types
import typing

_KIND = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def option(default, help: str, *, ge=None, gt=None, le=None, lt=None,
           choices: tuple | None = None, pattern: str | None = None, shape: str | None = None):
    """A dataclass field carrying its description and bounds (see the module docstring);
    ``shape`` says in words what ``pattern`` accepts, for the error message."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices,
            "pattern": pattern, "shape": shape}
    return dataclasses.field(default=default, metadata=meta)


def spec(cls) -> list[tuple[dataclasses.Field, type, bool]]:
    """Each option of dataclass ``cls``: (field, its base type, whether None is allowed)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        base, optional = hints[f.name], False
        if isinstance(base, types.UnionType) or typing.get_origin(base) is typing.Union:
            args = [a for a in typing.get_args(base) if a is not type(None)]
            base, optional = args[0], len(args) < len(typing.get_args(base))
        out.append((f, base, optional))
    return out


def _is_str_tuple(base) -> bool:
    """``tuple[str, ...]``: a list option (one flag taking several values, a YAML list)."""
    return typing.get_origin(base) is tuple


def validate(obj) -> None:
    """Raise ValueError naming the first option of ``obj`` outside its type or bounds."""
    for f, base, optional in spec(type(obj)):
        value, m = getattr(obj, f.name), f.metadata
        if value is None:
            if not optional:
                raise ValueError(f"{f.name} must not be None")
            continue
        if _is_str_tuple(base):
            ok = isinstance(value, tuple) and all(isinstance(v, str) for v in value)
            if not ok:
                raise ValueError(f"{f.name} must be a list of strings, got {value!r}")
            continue
        if base is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif base is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, base)
        if not ok:
            raise ValueError(f"{f.name} must be {_KIND.get(base, base.__name__)}, got {value!r}")
        if m.get("choices") is not None and value not in m["choices"]:
            raise ValueError(f"{f.name} must be one of {m['choices']}, got {value!r}")
        if m.get("pattern") is not None and not re.fullmatch(m["pattern"], value):
            raise ValueError(f"{f.name} must be {m['shape'] or 'like ' + m['pattern']}, "
                             f"got {value!r}")
        for bound, holds, word in (("ge", operator.ge, ">="), ("gt", operator.gt, ">"),
                                   ("le", operator.le, "<="), ("lt", operator.lt, "<")):
            if m.get(bound) is not None and not holds(value, m[bound]):
                raise ValueError(f"{f.name} must be {word} {m[bound]}, got {value}")


def add_flags(parser: argparse.ArgumentParser, cls, with_defaults: bool,
              only: tuple[str, ...] | None = None) -> None:
    """One ``--flag-name`` per option of ``cls`` (or of ``only``), typed, with its choices and
    description. ``with_defaults=False`` leaves unset flags at None, so a config file's
    value stands unless the flag is given."""
    for f, base, _ in spec(cls):
        if only is not None and f.name not in only:
            continue
        m = f.metadata
        flag = "--" + f.name.replace("_", "-")
        default = f.default if with_defaults else None
        text = m["help"] + (f" (default: {f.default})" if not with_defaults else "")
        if base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=text)
            continue
        if _is_str_tuple(base):
            parser.add_argument(flag, type=str, nargs="+", default=default, help=text)
            continue
        choices = [c for c in m["choices"] if c is not None] if m.get("choices") else None
        parser.add_argument(flag, type=base, default=default, choices=choices, help=text)


def from_flags(args: argparse.Namespace, cls) -> dict:
    """The options of ``cls`` that were set on the command line (not None)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items()
            if k in names and v is not None}
