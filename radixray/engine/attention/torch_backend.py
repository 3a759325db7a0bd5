"""``torch``: the reference attention backend (scaled_dot_product_attention), runs anywhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixray.engine.attention.base import AttentionBackend
from radixray.engine.executor.forward_batch import ForwardBatch, ForwardMode


class TorchAttention(AttentionBackend):
    """Reference backend built on ``scaled_dot_product_attention``.

    Decode gathers every request's keys/values into a padded ``[B, Lmax]`` block
    (one gather per layer for the whole batch); extend runs one SDPA call per
    request, reading its cached prefix through the request table.
    """

    name = "torch"

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        # The request table lives on the CPU; indices and masks go to the pool's device.
        device = self.kv_pool.device
        if batch.num_decode:
            self.init_mixed_metadata(batch)
        elif batch.mode is ForwardMode.DECODE:
            max_len = max(batch.seq_lens)
            idx = self.req_to_token[batch.req_rows, :max_len]
            lens = torch.tensor(batch.seq_lens, dtype=torch.int64)
            valid = torch.arange(max_len)[None, :] < lens[:, None]
            # Padding points at reserved slot 0 and is masked out.
            batch.attn_metadata["kv_indices"] = idx.masked_fill(~valid, 0).to(device)
            batch.attn_metadata["kv_mask"] = (None if bool(valid.all())
                                              else valid[:, None, None, :].to(device))
        else:
            batch.attn_metadata["prefix_indices"] = [
                self.req_to_token[row, :plen].to(device) if plen else None
                for row, plen in zip(batch.req_rows.tolist(), batch.prefix_lens)
            ]

    def forward(self, q, k, v, layer, batch):
        pool = self.kv_pool
        if batch.num_decode:
            return self.forward_mixed(q, k, v, layer, batch)
        if batch.mode is ForwardMode.DECODE:
            pool.write(layer, batch.out_cache_loc, k, v)
            return self._decode(q, layer, batch)
        # New keys/values are rounded to the pool's dtype once for the whole batch: the pool
        # stores those values and attention reads them widened back, so a request computes the
        # same whether its prefix came from the cache or was just prefilled.
        k, v = pool.write_rounded(layer, batch.out_cache_loc, k, v, q.dtype)
        return self._extend(q, k, v, layer, batch)

    def _decode(self, q, layer, batch):
        meta = batch.attn_metadata
        idx = meta["kv_indices"]
        # Attention runs in q's dtype whatever the pool stores.
        k_all = self.kv_pool.k_buffers[layer][idx].transpose(1, 2).to(q.dtype)  # [B, kvh, L, d]
        v_all = self.kv_pool.v_buffers[layer][idx].transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), k_all, v_all, attn_mask=meta["kv_mask"],
            scale=self.scaling, enable_gqa=True,
        )
        return out.squeeze(2)

    def _extend(self, q, k, v, layer, batch):
        outs = []
        start = 0
        kb, vb = self.kv_pool.k_buffers[layer], self.kv_pool.v_buffers[layer]
        for n, plen, prefix_idx in zip(batch.extend_lens, batch.prefix_lens,
                                       batch.attn_metadata["prefix_indices"]):
            ki, vi = k[start:start + n], v[start:start + n]  # already through the pool's dtype
            if plen:
                ki = torch.cat((kb[prefix_idx].to(q.dtype), ki))
                vi = torch.cat((vb[prefix_idx].to(q.dtype), vi))
            outs.append(self._attend(q[start:start + n], ki, vi, plen))
            start += n
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _attend(self, q, k, v, plen: int):
        """One request: q [n, h, d] over k/v [plen + n, kvh, d]; token i sees keys 0..plen+i."""
        n = q.shape[0]
        if plen:
            mask = torch.ones(n, plen + n, dtype=torch.bool, device=q.device).tril(diagonal=plen)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                scale=self.scaling, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                scale=self.scaling, enable_gqa=True)
        return out.transpose(0, 1)
