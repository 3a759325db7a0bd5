"""Admission: the token budget for a prefill batch, the new-token-ratio forecast, retraction order.

A new request must fit its uncached prompt tokens plus its remaining
``max_new_tokens`` (clipped to ``CLIP_MAX_NEW_TOKENS``). Every running request
holds back its remaining ``max_new_tokens`` times the current new-token ratio
(ratio 1 for ``ignore_eos`` requests, which cannot stop early).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixray.engine.request import Req

CLIP_MAX_NEW_TOKENS = 4096
INIT_RATIO_FACTOR = 0.7  # initial ratio = 0.7 x schedule_conservativeness
MIN_RATIO_FACTOR = 0.14  # the ratio decays to 0.14 of its initial value
RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20  # headroom per request assumed when re-estimating after a retraction


class NewTokenRatio:
    """Share of the remaining output a running request is expected to still use."""

    def __init__(self, schedule_conservativeness: float = 1.0):
        self.init = min(1.0, INIT_RATIO_FACTOR * schedule_conservativeness)
        self.min = self.init * MIN_RATIO_FACTOR
        self.decay = (self.init - self.min) / RATIO_DECAY_STEPS
        self.value = self.init

    def step(self) -> None:
        """One decode step went by without running out of memory."""
        self.value = max(self.value - self.decay, self.min)

    def reset_after_retraction(self, running: list[Req]) -> None:
        """Re-estimate from the survivors: (decoded so far + 20 per request) / total max_new_tokens."""
        total_max = sum(r.sampling.max_new_tokens for r in running)
        if total_max <= 0:
            self.value = self.init
            return
        decoded = sum(len(r.output_ids) for r in running)
        self.value = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(running)) / total_max)

    def reset(self) -> None:
        self.value = self.init


def reserved_for_running(running: list[Req], ratio: float) -> float:
    """Tokens the running requests are forecast to still need."""
    total = 0.0
    for r in running:
        remaining = min(r.remaining_new_tokens, CLIP_MAX_NEW_TOKENS)
        total += remaining * (1.0 if r.sampling.ignore_eos else ratio)
    return total


def new_request_need(extend_len: int, req: Req) -> int:
    """Tokens a new request must find room for: its uncached input plus clipped max_new_tokens."""
    return extend_len + min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS)


class AddResult:
    ADDED = "added"
    NO_TOKEN = "no_token"  # the token budget is spent: stop admitting
    CHUNKED = "chunked"  # added as a partial chunk: stop admitting
    OTHER = "other"  # input budget or request limit reached


@dataclass
class PrefillBudget:
    """Running totals while one prefill batch is assembled."""

    rem_total_tokens: float  # available KV minus forecasts of running + already-added requests
    rem_input_tokens: int  # max_prefill_tokens minus new tokens already added
    rem_chunk_tokens: int | None  # chunked_prefill_size minus tokens already added (None: no chunking)
    added: list[tuple[Req, int]] = field(default_factory=list)  # (request, tokens to compute now)

    @classmethod
    def start(cls, available: int, running: list[Req], ratio: float, max_prefill_tokens: int,
              chunked_prefill_size: int | None) -> PrefillBudget:
        return cls(available - reserved_for_running(running, ratio), max_prefill_tokens,
                   chunked_prefill_size)

    def try_add(self, req: Req, extend_len: int, force: bool = False) -> str:
        """Admit ``req`` with ``extend_len`` uncached tokens (or its first chunk) if it fits.

        ``force`` skips the output forecast (used when nothing else could ever free room).
        """
        if not force and new_request_need(extend_len, req) > self.rem_total_tokens:
            return AddResult.NO_TOKEN
        if self.added and extend_len > self.rem_input_tokens:
            return AddResult.OTHER
        n = extend_len
        if self.rem_chunk_tokens is not None and n > self.rem_chunk_tokens:
            if self.rem_chunk_tokens <= 0:
                return AddResult.OTHER
            n = self.rem_chunk_tokens
        self.added.append((req, n))
        self.rem_total_tokens -= new_request_need(extend_len, req)
        self.rem_input_tokens -= n
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= n
        return AddResult.CHUNKED if n < extend_len else AddResult.ADDED

    def reserve_riders(self, n: int, from_chunk: bool = True) -> None:
        """Mixed chunks: ``n`` running requests ride in this prefill forward, one token each,
        taken from the KV and input budgets, and with ``from_chunk`` from the chunk, which
        gives at most half of itself to them, so many streams cannot starve a prefill
        (a chunk sized by the ITL budget has counted the riders' time already)."""
        if not n:
            return
        self.rem_total_tokens -= n
        self.rem_input_tokens -= n
        if from_chunk and self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= min(n, self.rem_chunk_tokens // 2)

    def add_chunk_continuation(self, req: Req, remaining: int) -> int:
        """The request being chunk-prefilled continues first; its reservation is already counted."""
        n = remaining if self.rem_chunk_tokens is None else min(remaining, self.rem_chunk_tokens)
        self.added.append((req, n))
        self.rem_total_tokens -= remaining + min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS)
        self.rem_input_tokens -= n
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= n
        return n


def retraction_order(running: list[Req]) -> list[Req]:
    """Requests in the order to retract: fewest output tokens first, then longest prompt first."""
    return sorted(running, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))
