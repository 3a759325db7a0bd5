"""Req: the single per-request state the scheduler keeps (tokens, parameters, KV, timings)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixray.engine.sampling import SamplingParams

if TYPE_CHECKING:  # the controller and the router read requests' messages without torch
    import torch

    from radixray.engine.models.routed_experts import RoutedExpertsRecord


@dataclass
class FinishReason:
    """Why a request ended. ``type`` is stop | length | abort | error.

    ``error`` means the engine failed the request: ``message`` names the cause and
    ``status`` says whose problem it is, as an HTTP status: 500 for a fault in this
    request's batch (not retried: the request may be its cause), 503 when the whole
    engine stopped serving (safe to retry on another worker).
    """

    type: str
    matched: int | str | None = None  # the stop token id or stop string that matched
    length: int | None = None
    message: str | None = None
    status: int | None = None  # error only

    def to_dict(self) -> dict:
        d: dict = {"type": self.type}
        if self.type == "stop":
            d["matched"] = self.matched
        elif self.type == "length":
            d["length"] = self.length
        elif self.message:
            d["message"] = self.message
        if self.type == "error":
            d["status"] = self.status
        return d


@dataclass(eq=False)
class Req:
    """One request from arrival to finish.

    The token sequence is ``prompt_ids + output_ids``; KV exists in the pool for
    its first ``kv_len`` tokens. Of those, the first ``cache_locked_len`` belong
    to the radix tree (locked through ``last_node`` while the request runs); the
    rest are slots the request owns itself.
    """

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)

    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    # KV placement
    req_row: int | None = None
    kv_len: int = 0
    # slots written into the row past kv_len for the step in flight (KV not computed yet);
    # a request that fails mid-step returns them with the rest of its KV
    kv_reserved: int = 0
    cache_locked_len: int = 0
    last_node: object | None = None
    # the weights (the cache's generation) the KV so far was computed under (set at
    # admission); KV of older weights is never shared through the prefix cache
    # (engine/mem_cache/kv_manager.py)
    kv_version: int = 0
    # length of this step's new tokens (set when scheduled)
    extend_len: int = 0
    # LoRA: the adapter this request runs with (None: the base model) and its radix-cache
    # namespace (engine/weights/lora_slots.py): KV is shared only within one namespace
    lora: str | None = None
    lora_ns: int = 0
    lora_version: int | str = 0  # the adapter's version serving now (each update stamps it)

    # accounting the user sees
    cached_tokens: int = 0
    num_retractions: int = 0
    admit_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # return_logprob: prompt logprobs computed so far (engine/executor/prompt_logprobs.py);
    # entry i is the logprob of prompt token input_logprob_start + 1 + i after the tokens
    # before it (None when not asked). Handed out once, with the first update after prefill.
    input_logprobs: list[float] | None = None
    input_top_logprobs: list[list[tuple[int, float]]] | None = None
    input_logprobs_sent: bool = False
    # the MoE routers' choices for its computed tokens (return_routed_experts only)
    routed_experts: RoutedExpertsRecord | None = None
    generator: torch.Generator | None = None
    # how many output tokens have been handed to the caller
    emitted: int = 0
    # [weight version (int or string label), index of the first output token it produced],
    # one per version the request lived under (set at admission, extended by each weight
    # update it lives through)
    weight_spans: list[list] = field(default_factory=list)
    # disaggregation: the bootstrap room and the pair's other worker (PDBootstrap) while the
    # request is one half of a prefill-decode pair; None otherwise
    pd: object | None = None
    # structured output: the grammar state (engine/grammar/matcher.py) once compiled
    grammar: object | None = None
    # speculative decoding: verify forwards this request took part in with a draft, and
    # the tokens those committed (accepted drafts plus the target's own token)
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        if self.sampling.return_logprob and self.input_logprobs is None:
            self.input_logprobs, self.input_top_logprobs = [], []

    def commit_kv(self, n: int) -> None:
        """The step's forward pass wrote KV for the next ``n`` (reserved) tokens."""
        self.kv_len += n
        self.kv_reserved = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def cache_key(self, n: int) -> list[int]:
        """The radix-cache key of the first ``n`` tokens: the token ids, moved into the
        request's adapter namespace (``lora_ns << 32`` added to each id, so no key of one
        adapter, or of the base model, equals a key of another)."""
        ids = self.all_ids[:n]
        if not self.lora_ns:
            return ids
        offset = self.lora_ns << 32
        return [t + offset for t in ids]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def input_logprob_start(self) -> int:
        """The first prompt position reported in input_token_logprobs (``logprob_start_len``;
        -1 means the last prompt token, as in SGLang)."""
        start = self.sampling.logprob_start_len
        return start if start >= 0 else len(self.prompt_ids) - 1

    @property
    def input_logprobs_pending(self) -> bool:
        """Prompt logprobs remain to compute: the logits of positions
        ``input_logprob_start + len(input_logprobs)`` .. ``len(prompt_ids) - 2``."""
        return (self.input_logprobs is not None and
                self.input_logprob_start + len(self.input_logprobs) < len(self.prompt_ids) - 1)

    @property
    def prefix_limit(self) -> int:
        """The longest cached prefix this request may reuse: ``seq_len - 1`` (the last token
        always runs, to produce logits), and while prompt logprobs are pending no further than
        the first position whose logits they need (those positions are recomputed, not kept:
        the radix cache holds KV, never logits)."""
        limit = self.seq_len - 1
        if self.input_logprobs_pending:
            limit = min(limit, self.input_logprob_start + len(self.input_logprobs))
        return limit

    @property
    def owned_kv_len(self) -> int:
        """KV slots this request holds that the radix tree does not."""
        return self.kv_len - self.cache_locked_len

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.sampling.max_new_tokens - len(self.output_ids))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def reset_for_retraction(self) -> None:
        self.req_row = None
        self.kv_len = 0
        self.cache_locked_len = 0
        self.last_node = None
        self.num_retractions += 1
