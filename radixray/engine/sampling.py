"""Per-request sampling parameters and their validation.

Every check raises ``ValueError`` naming the field and its bound before the
request is scheduled, so a bad request changes nothing in the engine. Numbers
must be finite; values that are legal here but not representable in float32
(a ``top_p`` of 5e-324) are clamped by the sampler, never rejected there.

The numeric bounds are declared once, on the fields (:func:`bounds` reads them): the
HTTP protocol (serve/protocol.py) takes its bounds from there.
"""

from __future__ import annotations

import json
import math
import typing
from dataclasses import dataclass, field, fields

_GREEDY_EPS = 1e-6
MAX_SEED = 2**64 - 1  # torch generators take an unsigned 64-bit seed
_BOUND_KEYS = ("ge", "gt", "le")


def _bounded(default, *, ge=None, gt=None, le=None, unit: str = ""):
    """A field with inclusive (``ge``, ``le``) or exclusive (``gt``) bounds; ``unit`` says
    in words why an upper bound is what it is (for the error message)."""
    return field(default=default, metadata={"ge": ge, "gt": gt, "le": le, "unit": unit})


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 means greedy. top_k -1 means the whole vocabulary. Logprobs,
    when requested, come from the temperature-scaled distribution unless
    ``return_unscaled_logprob`` is set (greedy requests are always unscaled).
    """

    max_new_tokens: int = _bounded(128, ge=0)
    temperature: float = _bounded(1.0, ge=0)
    top_p: float = _bounded(1.0, gt=0, le=1)
    top_k: int = _bounded(-1, ge=-1)  # and not 0
    min_p: float = _bounded(0.0, ge=0, le=1)
    repetition_penalty: float = _bounded(1.0, gt=0)
    presence_penalty: float = _bounded(0.0, ge=-2, le=2)
    frequency_penalty: float = _bounded(0.0, ge=-2, le=2)
    seed: int | None = _bounded(None, ge=0, le=MAX_SEED, unit="64 bits")
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_logprob: bool = False
    top_logprobs_num: int = _bounded(0, ge=0)
    return_unscaled_logprob: bool = False
    # With return_logprob: prompt-token logprobs (input_token_logprobs) from this prompt
    # position on, of the model's raw distribution; -1 (SGLang's default) reports only the
    # last prompt token, whose entry (like every first one) has no logprob
    # (engine/executor/prompt_logprobs.py)
    logprob_start_len: int = _bounded(-1, ge=-1)
    # MoE models: report the experts each computed token was routed to (meta_info
    # routed_experts; which tokens: engine/models/routed_experts.py)
    return_routed_experts: bool = False
    # Structured output: at most one constraint (engine/grammar/); a JSON schema or a
    # structural tag (xgrammar's {"type": "structural_tag", "format": ...}) may be given as
    # a dict and is kept as its JSON text
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        """Build from a user dict; unknown keys are an error naming the key."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {unknown}; known: {sorted(known)}")
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if d.get("stop") is None:
            d.pop("stop", None)
        if d.get("stop_token_ids") is None:
            d.pop("stop_token_ids", None)
        for name in ("json_schema", "structural_tag"):
            if isinstance(d.get(name), dict):
                d[name] = json.dumps(d[name])
        return cls(**d)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first field outside its type or bound."""
        for f in _BOUNDED:
            value = getattr(self, f.name)
            if value is not None:
                _check_bounds(f, value)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1, got 0")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain an empty string")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
        for name in ("ignore_eos", "skip_special_tokens", "return_logprob", "return_unscaled_logprob",
                     "return_routed_experts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if vocab_size is not None and self.top_logprobs_num > vocab_size:
            raise ValueError(f"top_logprobs_num must be <= vocab size {vocab_size}, got {self.top_logprobs_num}")
        if any(getattr(self, k) is not None
               for k in ("json_schema", "regex", "ebnf", "structural_tag")):
            from radixray.engine.grammar.spec import check_syntax
            check_syntax(self)  # one constraint, and one xgrammar parses


_BOUNDED = [f for f in fields(SamplingParams) if "unit" in f.metadata]
_INTEGERS = {name for name, kind in typing.get_type_hints(SamplingParams).items()
             if kind in (int, int | None)}


def bounds(name: str) -> dict:
    """The bounds of field ``name`` as pydantic's ``Field`` takes them (``ge``, ``gt``,
    ``le``; only those the field has)."""
    meta = next(f.metadata for f in _BOUNDED if f.name == name)
    return {k: meta[k] for k in _BOUND_KEYS if meta[k] is not None}


def _check_bounds(f, value) -> None:
    """Integer fields: an int within each bound, named one at a time. Float fields: a
    finite number within the range, named as an interval (``top_p must be in (0, 1]``)."""
    name, m = f.name, f.metadata
    lo, lo_open, hi = (m["gt"], True, m["le"]) if m["gt"] is not None else (m["ge"], False, m["le"])
    if name in _INTEGERS:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if lo is not None and value < lo:
            raise ValueError(f"{name} must be >= {lo}, got {value}")
        if hi is not None and value > hi:
            unit = f" ({m['unit']})" if m["unit"] else ""
            raise ValueError(f"{name} must be <= {hi}{unit}, got {value}")
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    below = lo is not None and (value <= lo if lo_open else value < lo)
    if below or (hi is not None and value > hi):
        if hi is None:
            shape = f"{'>' if lo_open else '>='} {lo}"
        else:
            shape = f"in {'(' if lo_open else '['}{lo}, {hi}]"
        raise ValueError(f"{name} must be {shape}, got {value}")
