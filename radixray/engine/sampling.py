"""Per-request sampling parameters and their validation.

Every check raises ``ValueError`` naming the field and its bound before the
request is scheduled, so a bad request changes nothing in the engine. Numbers
must be finite; values that are legal here but not representable in float32
(a ``top_p`` of 5e-324) are clamped by the sampler, never rejected there.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields

_GREEDY_EPS = 1e-6
MAX_SEED = 2**64 - 1  # torch generators take an unsigned 64-bit seed


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 means greedy. top_k -1 means the whole vocabulary. Logprobs,
    when requested, come from the temperature-scaled distribution unless
    ``return_unscaled_logprob`` is set (greedy requests are always unscaled).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_unscaled_logprob: bool = False
    # MoE models: report the experts each computed token was routed to (meta_info
    # routed_experts; which tokens: engine/models/routed_experts.py)
    return_routed_experts: bool = False
    # Structured output: at most one constraint (engine/grammar/); a JSON schema may be
    # given as a dict and is kept as its JSON text
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

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
        if isinstance(d.get("json_schema"), dict):
            d["json_schema"] = json.dumps(d["json_schema"])
        return cls(**d)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first field outside its bound."""
        _check_int("max_new_tokens", self.max_new_tokens, lo=0)
        _check_num("temperature", self.temperature, lo=0.0, bound="temperature must be >= 0")
        _check_num("top_p", self.top_p, bound="top_p must be in (0, 1]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, lo=-1)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1, got 0")
        _check_num("min_p", self.min_p, bound="min_p must be in [0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_num("repetition_penalty", self.repetition_penalty, bound="repetition_penalty must be > 0")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_num(name, value, bound=f"{name} must be in [-2, 2]")
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0)
            if self.seed > MAX_SEED:
                raise ValueError(f"seed must be <= {MAX_SEED} (64 bits), got {self.seed}")
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
        _check_int("top_logprobs_num", self.top_logprobs_num, lo=0)
        if vocab_size is not None and self.top_logprobs_num > vocab_size:
            raise ValueError(f"top_logprobs_num must be <= vocab size {vocab_size}, got {self.top_logprobs_num}")
        if self.json_schema is not None or self.regex is not None or self.ebnf is not None:
            from radixray.engine.grammar.spec import check_syntax
            check_syntax(self)  # one constraint, and one xgrammar parses


def _check_int(name: str, value, lo: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")


def _check_num(name: str, value, lo: float | None = None, bound: str = "") -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{bound}, got {value}")
