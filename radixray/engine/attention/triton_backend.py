"""``triton``: decode and extend attention in triton kernels (radixray/kernels/
triton_attention.py) over the paged pool, for CUDA devices.

Decode runs the split-K kernel over each request's slots; extend (prefill, chunked prefill)
runs one flash-attention kernel over each request's cached prefix in the pool and its new
tokens, causal over the new ones. The new tokens' keys and values are written into the pool
by the triton store kernel first and read back as the pool holds them, so a prompt computes
the same whether its prefix came from the cache or was just prefilled (as ``torch`` does).

On the CPU the kernels run only under triton's interpreter (``TRITON_INTERPRET=1``): slow,
for checking the kernels against the torch references (tests/cpu), not for serving.
"""

from __future__ import annotations

import os

import torch

from radixray.engine.attention.base import AttentionBackend
from radixray.engine.attention.paged_table import (
    StaticPageTable,
    as_pages,
    indptr_of,
    page_table,
)
from radixray.engine.executor.forward_batch import ForwardBatch, ForwardMode
from radixray.engine.mem_cache.pool import to_pool_dtype


def triton_usable(device) -> str | None:
    """Why the triton backend cannot run on ``device`` (None: it can)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install 'radixray[gpu]', or pip install triton)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (f"the triton kernels run on CUDA devices; the KV pool is on {device} (set "
                f"TRITON_INTERPRET=1 to run them on the CPU through triton's interpreter, "
                f"for checking only: it is very slow)")
    return None


class TritonAttention(AttentionBackend):
    """Paged attention in triton kernels; see the module docstring."""

    name = "triton"
    supports_cuda_graph = True

    def __init__(self, req_to_token, kv_pool, scaling):
        super().__init__(req_to_token, kv_pool, scaling)
        reason = triton_usable(kv_pool.device)
        if reason is not None:
            raise ValueError(f"attention_backend='triton': {reason}")
        from radixray.kernels import triton_attention
        self.kernels = triton_attention

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.num_decode:
            self.init_mixed_metadata(batch)
            return
        device = self.kv_pool.device
        meta = batch.attn_metadata
        if batch.mode is ForwardMode.DECODE:
            meta["table"] = page_table(self.req_to_token, batch.req_rows, batch.seq_lens, device)
        else:
            meta["table"] = page_table(self.req_to_token, batch.req_rows, batch.prefix_lens,
                                       device)
            meta["qo_indptr"] = indptr_of(batch.extend_lens, device)

    # ---- decode CUDA graphs (engine/executor/cuda_graph.py) ---------------------------------
    def init_graph_buffers(self, max_bs: int, num_q_heads: int, q_dtype: torch.dtype) -> None:
        """A static page table for decode batches of up to ``max_bs`` rows, and a fixed
        split count (a graph's grid is fixed): the context length's."""
        self._graph_table = StaticPageTable(max_bs, self.kv_pool.size + 1, self.kv_pool.device)
        self._graph_splits = self.kernels.default_num_kv_splits(self.req_to_token.shape[1])

    def prepare_graph(self, batch: ForwardBatch, bs: int) -> None:
        """Write decode ``batch``'s (``bs`` rows, padded) page table into the static
        buffers, and point its metadata at them."""
        batch.attn_metadata["table"] = self._graph_table.fill(self.req_to_token,
                                                              batch.req_rows, batch.seq_lens)
        batch.attn_metadata["num_kv_splits"] = self._graph_splits

    def forward(self, q, k, v, layer, batch):
        if batch.num_decode:
            return self.forward_mixed(q, k, v, layer, batch)
        pool = self.kv_pool
        k_pages, v_pages = as_pages(pool.k_buffers[layer]), as_pages(pool.v_buffers[layer])
        self.kernels.store_kv(k_pages, v_pages, batch.out_cache_loc, k, v)
        table = batch.attn_metadata["table"]
        if batch.mode is ForwardMode.DECODE:
            return self.kernels.decode_attention(
                q, k_pages, v_pages, table.indptr, table.indices, table.lens, self.scaling,
                num_kv_splits=batch.attn_metadata.get("num_kv_splits"))
        # the new tokens as the pool stores them (rounded to its dtype), in q's dtype
        k_new = to_pool_dtype(k, pool.dtype).to(q.dtype)
        v_new = to_pool_dtype(v, pool.dtype).to(q.dtype)
        return self.kernels.extend_attention(
            q, k_new, v_new, k_pages, v_pages, batch.attn_metadata["qo_indptr"], table.indptr,
            table.indices, table.lens, self.scaling)
