"""Per-token logprobs of whole sequences through the workers' own forward, batch-invariant.

A deterministic engine gives every token the same bits whatever batch and prefill chunks
it ran in (:class:`~radixray.kernels.cpu_ops.BatchInvariantKernels`,
:class:`~radixray.engine.attention.BatchInvariantAttention`). So a sequence prefilled
whole here, with the same model class, kernels and weights, yields exactly the logprobs
the engine returned while it sampled that sequence token by token: the GRPO trainer's
"old policy" and its own forward agree to the bit (a true on-policy ratio of 1).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from radixray.engine.attention import BatchInvariantAttention
from radixray.engine.executor.forward_batch import ForwardBatch, ForwardMode
from radixray.engine.executor.model_runner import attention_scaling, head_dim_of
from radixray.engine.executor.sampler import unscaled_logprobs
from radixray.engine.mem_cache.pool import KVPool, ReqToTokenPool
from radixray.engine.models import model_class_for
from radixray.kernels.cpu_ops import BatchInvariantKernels


class SequenceScorer:
    """The engine's model in deterministic mode, scoring sequences packed into forwards of
    up to ``max_tokens`` tokens (the size of its KV pool, so also the longest sequence)."""

    def __init__(self, hf_config, max_tokens: int = 2048):
        hf = hf_config
        self.kernels = BatchInvariantKernels()
        self.context_len = hf.max_position_embeddings
        self.model = model_class_for(hf)(hf, torch.float32, max_positions=self.context_len,
                                         kernels=self.kernels).eval()
        self.max_tokens = max_tokens
        self.pool = KVPool(max_tokens, hf.num_hidden_layers,
                           hf.num_key_value_heads, head_dim_of(hf), torch.float32,
                           ext=self.kernels.ext)
        self.rows = ReqToTokenPool(max_tokens // 2, min(self.context_len, max_tokens))
        attn = BatchInvariantAttention(self.rows.table, self.pool, attention_scaling(hf))
        for layer in self.model.attention_layers():
            layer.attn = attn
        self.attn = attn

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face-named weights, all of them (ValueError names a missing or odd one)."""
        self.model.load_weights(named)

    def logprobs(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """For each sequence, [len - 1] fp32: the logprob of token t after tokens 0..t-1."""
        most = min(self.context_len, self.max_tokens)
        for i, seq in enumerate(sequences):
            if not 2 <= len(seq) <= most:
                raise ValueError(f"sequences[{i}] has {len(seq)} tokens; scoring takes 2 to "
                                 f"{most} (max_tokens={self.max_tokens}, context "
                                 f"{self.context_len})")
        out: list[torch.Tensor] = []
        pack: list[list[int]] = []
        packed = 0
        for seq in sequences:
            if pack and packed + len(seq) > self.max_tokens:
                out.extend(self._forward(pack))
                pack, packed = [], 0
            pack.append(seq)
            packed += len(seq)
        if pack:
            out.extend(self._forward(pack))
        return out

    @torch.inference_mode()
    def _forward(self, pack: list[list[int]]) -> list[torch.Tensor]:
        lens = [len(s) for s in pack]
        slots = torch.arange(1, sum(lens) + 1, dtype=torch.int64)
        start = 0
        for row, n in enumerate(lens, start=1):
            self.rows.table[row, :n] = slots[start:start + n]
            start += n
        ids = torch.tensor([t for s in pack for t in s], dtype=torch.int64)
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=ids,
            positions=torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]),
            out_cache_loc=slots, req_rows=torch.arange(1, len(pack) + 1, dtype=torch.int64),
            prefix_lens=[0] * len(pack), extend_lens=lens, seq_lens=lens, all_logits=True)
        self.attn.init_forward_metadata(batch)
        logits = self.model(batch)
        out, start = [], 0
        for n in lens:
            out.append(unscaled_logprobs(logits[start:start + n - 1], ids[start + 1:start + n]))
            start += n
        return out
