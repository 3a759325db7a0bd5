"""The tensors one forward pass needs, built by the model runner from a scheduled batch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixray.engine.executor.prompt_logprobs import PromptLogprobRows
    from radixray.engine.request import Req
    from radixray.engine.weights.lora_slots import LoraBatch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill: each request adds one or more tokens after an optional cached prefix
    DECODE = "decode"  # each request adds exactly one token


@dataclass
class ForwardBatch:
    """Packed inputs of one step.

    Tokens of all requests are concatenated in batch order: request ``i`` owns
    ``extend_lens[i]`` consecutive rows. ``prefix_lens[i]`` tokens of request ``i``
    already have KV in the pool; after the step it has ``seq_lens[i]`` tokens.
    ``out_cache_loc`` holds the KV slot each new token writes.
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64
    req_rows: torch.Tensor  # [B] int64 rows of ReqToTokenPool
    prefix_lens: list[int]
    extend_lens: list[int]
    seq_lens: list[int]
    # Filled by the attention backend's init_forward_metadata, once per step.
    attn_metadata: dict = field(default_factory=dict)
    # Extend only: logits for every new token, not just each request's last (scoring).
    all_logits: bool = False
    # Extend only: rows whose final hidden states prompt logprobs need besides each request's
    # last (engine/executor/prompt_logprobs.py); the model leaves them in ``prompt_rows.hidden``.
    prompt_rows: PromptLogprobRows | None = None
    # Requests that asked for their routed experts: (request, first row, rows, position of
    # the first row). When any did, a MoE model leaves every row's top-k logical expert
    # ids in ``routed_experts`` [T, MoE layers, top_k] (the model runner hands them out).
    route_captures: list[tuple[Req, int, int, int]] = field(default_factory=list)
    routed_experts: torch.Tensor | None = None
    # Mixed chunked prefill (engine/sched/mixed_batch.py): the last ``num_decode`` requests of an
    # extend batch are decode requests, one token each at position ``prefix_lens[i]``;
    # attention runs them as a decode (attention/base.py ``split_mixed``).
    num_decode: int = 0
    # LoRA: each row's adapter slot and the slots' weights; None when no request of the
    # batch uses an adapter (engine/weights/lora_slots.py)
    lora: LoraBatch | None = None

    def to_device(self, device: str) -> None:
        """Move the token-wise tensors (ids, positions, cache slots) to ``device``.

        ``req_rows`` stays on the CPU: it indexes the request table, which lives there."""
        self.input_ids = self.input_ids.to(device, non_blocking=True)
        self.positions = self.positions.to(device, non_blocking=True)
        self.out_cache_loc = self.out_cache_loc.to(device, non_blocking=True)
        if self.lora is not None:
            self.lora.to(device)

    @property
    def decode_only(self) -> bool:
        """A decode batch with nothing beside its tokens and its adapters, if any (no riders'
        extends, no routes or prompt rows to keep)."""
        return (self.mode is ForwardMode.DECODE and not self.num_decode
                and not self.route_captures and self.prompt_rows is None)

    @property
    def plain_decode(self) -> bool:
        """:attr:`decode_only` without adapters: what a captured CUDA graph can run."""
        return self.decode_only and self.lora is None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def last_token_rows(self) -> torch.Tensor:
        """Row index of each request's last new token (where its next-token logits come from),
        on the device of ``input_ids``."""
        device = self.input_ids.device
        if self.mode is ForwardMode.DECODE:
            return torch.arange(self.batch_size, device=device)
        ends = torch.tensor(self.extend_lens, dtype=torch.int64).cumsum(0)
        return (ends - 1).to(device)


class LargestDecodeBatch:
    """The most requests a captured or compiled decode step takes; the first larger batch is
    logged once with ``message % (its size, max_bs)`` (it runs eagerly)."""

    def __init__(self, max_bs: int, message: str, logger):
        self.max_bs, self.message, self.logger = max_bs, message, logger
        self._warned = False

    def admits(self, batch: ForwardBatch) -> bool:
        if batch.batch_size <= self.max_bs:
            return True
        if not self._warned:
            self._warned = True
            self.logger.info(self.message, batch.batch_size, self.max_bs)
        return False
