"""Request ids: one id per HTTP request (its *base* id), one per generation it starts.

A request that starts one generation runs under its base id. One that starts several (a
batch of prompts, ``n`` > 1) runs choice ``i`` under ``f"{base}_{i}"``, as SGLang names a
batch's requests, so the base id still names all of them: aborting an id aborts the
request of that id and every choice derived from it (``<id>_<digits>``), and nothing else
(``abc`` does not abort ``abcd`` nor ``abc_x``). No torch, no Ray: every layer uses it.
"""

from __future__ import annotations

import uuid

CHOICE_SEPARATOR = "_"
MAX_RID_LENGTH = 256  # of an id a client gives


def new_rid() -> str:
    """A fresh base id (32 hex digits)."""
    return uuid.uuid4().hex


def choice_rids(base: str, n: int) -> list[str]:
    """The ids of a request's ``n`` generations: ``[base]`` for one, else ``base_0`` ...
    ``base_{n-1}``."""
    if n == 1:
        return [base]
    return [f"{base}{CHOICE_SEPARATOR}{i}" for i in range(n)]


def belongs_to(rid: str, target: str) -> bool:
    """Whether aborting ``target`` aborts the generation ``rid``: the same id, or a choice
    derived from it (``target_<digits>``)."""
    if rid == target:
        return True
    prefix = target + CHOICE_SEPARATOR
    return rid.startswith(prefix) and rid[len(prefix):].isdigit()
