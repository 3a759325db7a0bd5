"""The closed sets of the engine's control verbs, declared once for every layer.

Pause modes (what ``pause_generation`` does to running requests: engine/sched/pause.py)
and memory tags (what ``release_memory_occupation`` frees: engine/mem_cache/memory_saver.py).
The HTTP protocol, the fleet's weight update and the RL job's config check their input
against these. This module imports nothing heavy, so the ingress and the configs can use
it without loading torch.
"""

from __future__ import annotations

from typing import Literal

PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("kv_cache", "weights")
# A weight update stages the new weights by reading the serving ones, so only the KV pool
# may be released while it runs (the freed pool makes room for the staged copy).
RELEASABLE_DURING_UPDATE = ("kv_cache",)

# The same sets as types, for pydantic schemas (``Literal[("a", "b")]`` is ``Literal["a", "b"]``)
PauseMode = Literal[PAUSE_MODES]
MemoryTag = Literal[MEMORY_TAGS]
ReleasableDuringUpdate = Literal[RELEASABLE_DURING_UPDATE]
