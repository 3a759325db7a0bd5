"""What one tensor-parallel rank holds of a dense decoder, and its slice of each checkpoint
tensor.

Megatron-style split over ``size`` ranks, as SGLang does it:

- attention: the query heads split evenly (q column-parallel); key/value heads split
  evenly too when there are at least ``size`` of them, else each rank holds one, the KV
  head its query heads read (``size`` a multiple of the KV heads: replicated
  ``size // kv_heads`` times). ``o_proj`` is row-parallel: each rank multiplies its heads'
  columns and the partial outputs are summed (an all-reduce);
- the MLP: ``gate_proj`` and ``up_proj`` column-parallel (rows of the intermediate size),
  ``down_proj`` row-parallel, then an all-reduce; in a mixture-of-experts block every
  expert (and the shared expert) is split so, the router is whole on every rank, and one
  all-reduce sums the block's output;
- the embedding and ``lm_head``: vocab-parallel, ``ceil(vocab / size)`` rows each (the last
  rank's padded with zero rows); embeddings are summed across ranks (a token's row is on
  one of them), logits gathered before sampling;
- norms (and Qwen3's per-head q/k norms) are whole on every rank.

A bias of a row-parallel projection is added once: rank 0 holds it, the others zeros.

A size that does not divide the query heads, or the KV heads (nor is a multiple of them),
or the intermediate size, is refused with the numbers (:func:`check_tp_size`): uneven
shards are not implemented.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

# checkpoint-name leaf -> how it splits ("col": rows of the output, "row": columns of the
# input; the family says whose sizes)
_SPLITS = {
    "q_proj": ("col", "q"), "k_proj": ("col", "kv"), "v_proj": ("col", "kv"),
    "o_proj": ("row", "q"),
    "gate_proj": ("col", "inter"), "up_proj": ("col", "inter"), "down_proj": ("row", "inter"),
    "embed_tokens": ("col", "vocab"), "lm_head": ("col", "vocab"),
}
_NAME = re.compile(r"(?:^|\.)(\w+)\.(weight|bias)$")


def check_tp_size(hf_config, size: int) -> None:
    """ValueError naming the head counts (or the intermediate size) ``size`` does not
    divide; nothing for size 1."""
    if size == 1:
        return
    q, kv = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if q % size:
        raise ValueError(f"tp_size {size} does not divide the model's {q} attention (query) "
                         f"heads; use a tp_size that divides {q} and its {kv} KV heads")
    if kv % size and size % kv:
        raise ValueError(f"tp_size {size} neither divides the model's {kv} KV heads nor is a "
                         f"multiple of them (query heads: {q})")
    for field in ("intermediate_size", "moe_intermediate_size",
                  "shared_expert_intermediate_size"):
        inter = getattr(hf_config, field, None)
        if inter and inter % size:
            raise ValueError(f"tp_size {size} does not divide the model's {field} {inter}")


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of ``size``: the local sizes and which rows of each family it holds."""

    rank: int
    size: int
    num_heads: int  # the model's query heads
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, hf_config, rank: int = 0, size: int = 1) -> TPShard:
        check_tp_size(hf_config, size)
        head_dim = (getattr(hf_config, "head_dim", None)
                    or hf_config.hidden_size // hf_config.num_attention_heads)
        return cls(rank, size, hf_config.num_attention_heads, hf_config.num_key_value_heads,
                   head_dim, getattr(hf_config, "intermediate_size", 0) or 0,
                   hf_config.vocab_size)

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def kv_head_start(self) -> int:
        """The first KV head this rank holds (the one its query heads read when replicated)."""
        if self.num_kv_heads >= self.size:
            return self.rank * self.local_kv_heads
        return self.rank // (self.size // self.num_kv_heads)

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.size

    @property
    def local_vocab(self) -> int:
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.local_vocab

    def rows(self, family: str) -> tuple[int, int]:
        """(first row, row count) this rank holds of a family's dimension."""
        if family == "q":
            return self.rank * self.local_heads * self.head_dim, self.local_heads * self.head_dim
        if family == "kv":
            return self.kv_head_start * self.head_dim, self.local_kv_heads * self.head_dim
        if family == "inter":
            return self.rank * self.local_intermediate, self.local_intermediate
        if family == "vocab":
            return self.vocab_start, self.local_vocab
        raise ValueError(family)

    def splits(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` differs per rank."""
        return self.size > 1 and _split_of(name) is not None

    def local(self, name: str, tensor: torch.Tensor,
              local_shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` (the whole tensor when it is not
        split). ``local_shape``: the shape the model holds of it; an MLP projection's share
        is read from it (a dense MLP, a routed expert and a shared expert differ in size)."""
        split = _split_of(name) if self.size > 1 else None
        if split is None:
            return tensor
        (how, family), kind = split
        if family == "inter" and local_shape is not None:
            count = local_shape[1] if how == "row" and kind == "weight" else local_shape[0]
            start = self.rank * count
        else:
            start, count = self.rows(family)
        if how == "row":
            if kind == "bias":  # added once, after the all-reduce
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            return tensor.narrow(1, start, count)
        part = tensor[start:start + count]
        if part.shape[0] < count:  # the vocabulary's padding rows
            pad = torch.zeros((count - part.shape[0], *tensor.shape[1:]), dtype=tensor.dtype,
                              device=tensor.device)
            part = torch.cat((part, pad))
        return part


def _split_of(name: str):
    m = _NAME.search(name)
    if m is None or m.group(1) not in _SPLITS:
        return None
    return _SPLITS[m.group(1)], m.group(2)
