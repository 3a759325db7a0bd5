"""``flashinfer``: decode and prefill attention in flashinfer's kernels over the paged pool
(CUDA only; ``pip install 'radixray[gpu]'``).

Each batch is planned once (the wrappers' ``plan``, on the first layer's call, when the
query head count is known) and every layer runs the planned kernel. The pool is viewed as
pages of one token in flashinfer's NHD layout (``[pages, 1, kv_heads, head_dim]``). Extend
writes the new tokens' keys and values into the pool first and attends over the request's
whole row of the table (cached prefix + new tokens), causal with the new tokens aligned to
the end, so a prompt reads the same values whether its prefix was cached or not.

flashinfer is imported when the backend is created, never at module import.
"""

from __future__ import annotations

import torch

from radixray.engine.attention.base import AttentionBackend
from radixray.engine.attention.paged_table import (
    PAGE_SIZE,
    StaticPageTable,
    as_pages,
    indptr_of,
    page_table,
)
from radixray.engine.executor.forward_batch import ForwardBatch, ForwardMode

WORKSPACE_BYTES = 256 << 20  # flashinfer's scratch for split-KV partial results


def load_flashinfer(device: torch.device):
    """The flashinfer module; ValueError saying what to do when it cannot run here."""
    if device.type != "cuda":
        raise ValueError(f"attention_backend='flashinfer' runs on CUDA devices; the KV pool is "
                         f"on {device} (use 'auto', 'torch' or 'cpu_paged' there)")
    try:
        import flashinfer
    except ImportError as exc:
        raise ValueError(f"attention_backend='flashinfer' needs the flashinfer-python package "
                         f"({exc}): pip install 'radixray[gpu]', or choose "
                         f"attention_backend='triton'") from None
    return flashinfer


class FlashInferAttention(AttentionBackend):
    """Paged attention in flashinfer's wrappers; see the module docstring."""

    name = "flashinfer"
    supports_cuda_graph = True

    def __init__(self, req_to_token, kv_pool, scaling):
        super().__init__(req_to_token, kv_pool, scaling)
        self.flashinfer = flashinfer = load_flashinfer(kv_pool.device)
        if kv_pool.dtype == torch.float32:
            raise ValueError("attention_backend='flashinfer' runs 16-bit attention over a "
                             "16-bit or fp8 KV pool; the pool is float32: use dtype bfloat16 "
                             "(what auto picks on a GPU), or attention_backend='triton' for "
                             "float32")
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=kv_pool.device)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.num_decode:
            self.init_mixed_metadata(batch)
            return
        device = self.kv_pool.device
        meta = batch.attn_metadata
        # the whole row: a decode's tokens, or an extend's prefix and new tokens (the new
        # tokens' slots are in the table before the step runs)
        meta["table"] = page_table(self.req_to_token, batch.req_rows, batch.seq_lens, device)
        if batch.mode is ForwardMode.EXTEND:
            meta["qo_indptr"] = indptr_of(batch.extend_lens, device)
        meta["planned"] = False

    # ---- decode CUDA graphs (engine/executor/cuda_graph.py) ---------------------------------
    def init_graph_buffers(self, max_bs: int, num_q_heads: int, q_dtype: torch.dtype) -> None:
        """flashinfer's CUDA-graph decode wrappers (one per bucket, made on first use) read
        their page table from a static one, which ``plan`` fills before each replay."""
        self._graph_table = StaticPageTable(max_bs, self.kv_pool.size + 1, self.kv_pool.device)
        self._graph_last = torch.ones(max_bs, dtype=torch.int32, device=self.kv_pool.device)
        self._graph_wrappers: dict[int, object] = {}
        self._graph_shape = (num_q_heads, q_dtype)

    def prepare_graph(self, batch: ForwardBatch, bs: int) -> None:
        """Plan decode ``batch`` (``bs`` rows, padded) on bucket ``bs``'s graph wrapper,
        outside the graph; the captured ``run`` reads the plan."""
        static = self._graph_table
        wrapper = self._graph_wrappers.get(bs)
        if wrapper is None:
            wrapper = self._graph_wrappers[bs] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True,
                paged_kv_indptr_buffer=static.indptr[:bs + 1],
                paged_kv_indices_buffer=static.indices,
                paged_kv_last_page_len_buffer=self._graph_last[:bs])
        pool = self.kv_pool
        table = page_table(self.req_to_token, batch.req_rows, batch.seq_lens, pool.device)
        heads, q_dtype = self._graph_shape
        wrapper.plan(table.indptr, table.indices, self._graph_last[:bs], heads,
                     pool.num_kv_heads, pool.head_dim, PAGE_SIZE, pos_encoding_mode="NONE",
                     q_data_type=q_dtype, kv_data_type=pool.dtype, sm_scale=self.scaling)
        batch.attn_metadata.update(table=table, planned=True, wrapper=wrapper)

    def _plan(self, q: torch.Tensor, batch: ForwardBatch) -> None:
        meta, pool = batch.attn_metadata, self.kv_pool
        table = meta["table"]
        last_page_len = torch.ones_like(table.lens)  # pages of one token are always full
        shape = (q.shape[1], pool.num_kv_heads, pool.head_dim, PAGE_SIZE)
        if batch.mode is ForwardMode.DECODE:
            self.decode.plan(table.indptr, table.indices, last_page_len, *shape,
                             pos_encoding_mode="NONE", q_data_type=q.dtype,
                             kv_data_type=pool.dtype, sm_scale=self.scaling)
        else:
            self.prefill.plan(meta["qo_indptr"], table.indptr, table.indices, last_page_len,
                              *shape, causal=True, sm_scale=self.scaling, q_data_type=q.dtype,
                              kv_data_type=pool.dtype)
        meta["planned"] = True

    def forward(self, q, k, v, layer, batch):
        if batch.num_decode:
            return self.forward_mixed(q, k, v, layer, batch)
        pool = self.kv_pool
        pool.write(layer, batch.out_cache_loc, k, v)
        if not batch.attn_metadata["planned"]:
            self._plan(q, batch)
        cache = (as_pages(pool.k_buffers[layer]), as_pages(pool.v_buffers[layer]))
        wrapper = batch.attn_metadata.get("wrapper") or (
            self.decode if batch.mode is ForwardMode.DECODE else self.prefill)
        return wrapper.run(q.contiguous(), cache)
