"""Weight versions: the name of the weights an engine (or a fleet) serves. Torch-free, so
the controller checks versions without importing the engine.

A version is an ``int`` or a ``str``, as SGLang's RL clients send it (a step tag such as
``"v1"`` or ``"step_12"``):

* an int must be greater than every int version served before (the *floor*; the first
  load is version 0), so integer versions only grow, across string labels in between too
  (``3`` -> ``"v1"`` -> ``2`` refuses the ``2``);
* a string is a label with no order: any non-empty string of at most
  :data:`MAX_LABEL_CHARS` characters is taken, the current label and older ones included,
  as SGLang takes it (its RL clients name the same version on every bucket of a bucketed
  update, and each bucket is one update here).

A version only labels the weights: KV reuse never relies on it (the engine keys its prefix
cache by a private generation count that grows with every commit, see
``WeightUpdater.generation``), so two different weights under one label never share KV.

A refused version raises :class:`VersionRefused` (a ValueError naming ``weight_version``)
before anything changes; the weight-update session that asked stays open.
"""

from __future__ import annotations

WeightVersion = int | str

MAX_LABEL_CHARS = 256


class VersionRefused(ValueError):
    """A weight version the rules above refuse (nothing changed; a session stays open)."""


def check_version(version, floor: int,
                  why: str = "the greatest integer version served so far") -> WeightVersion:
    """``version`` if it may name the next weights, given ``floor`` (the greatest int
    version served so far; ``why`` says what the bound is); else VersionRefused naming
    ``weight_version`` and the bound."""
    if isinstance(version, str):
        if 0 < len(version) <= MAX_LABEL_CHARS:
            return version
        raise VersionRefused(f"weight_version: a string label must be 1 to {MAX_LABEL_CHARS} "
                             f"characters, got {len(version)}")
    if isinstance(version, bool) or not isinstance(version, int):
        raise VersionRefused(f"weight_version must be an integer or a string label, got "
                             f"{type(version).__name__} {version!r}")
    if version <= floor:
        raise VersionRefused(f"weight_version must be an integer greater than {floor} ({why}) "
                             f"or a string label, got {version}")
    return version


def raise_floor(floor: int, version: WeightVersion) -> int:
    """The floor once ``version`` serves."""
    return max(floor, version) if isinstance(version, int) else floor


def default_version(floor: int) -> int:
    """The version of an update that names none: the next integer."""
    return floor + 1
