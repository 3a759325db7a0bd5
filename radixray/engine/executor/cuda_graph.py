"""Decode CUDA graphs: one captured decode forward per batch-size bucket, replayed.

A decode step of a small batch on a GPU is mostly kernel launches: hundreds per step, each
a few microseconds of CPU. Capturing the step once per batch size and replaying it issues
them all at once. The buckets are 1, 2, 4, 8, then every 8 up to ``cuda_graph_max_bs``
(sized from the device's memory unless configured); a batch is padded to its bucket with
rows that read and write the pool's padding slot 0 through the request table's padding
row 0, and its real rows' logits are cut out of the bucket's output. A batch larger than
the largest bucket, an extend or mixed batch, or one that records routes, runs eagerly.

Capture needs every per-step input in a tensor whose address does not change: the token
ids, positions and cache slots live in static buffers here, and the attention backend
keeps its per-step metadata in static buffers of its own (``init_graph_buffers``,
``prepare_graph``; only backends with ``supports_cuda_graph``: triton and flashinfer).

A graph holds the addresses of the weights and of the KV pool it read at capture: when
those change (a weight update's commit or rollback swaps tensors; a memory release frees
their storages) :meth:`DecodeGraphs.invalidate` drops the graphs and the next decode step
captures them again. The graphs' own memory is the ``cuda_graph`` tag of
``release_memory_occupation``.

``capture=False`` runs the same static-buffer path without capturing (on the CPU, with the
triton kernels under ``TRITON_INTERPRET=1``): what the tests check on machines without a
GPU; capture and replay are then the only part left to a GPU.
"""

from __future__ import annotations

import logging
import time

import torch

from radixray.engine.executor.forward_batch import (
    ForwardBatch,
    ForwardMode,
    LargestDecodeBatch,
)

logger = logging.getLogger(__name__)

GIB = 2**30


def capture_sizes(max_bs: int) -> list[int]:
    """The bucket sizes: 1, 2, 4, 8, then every 8 up to ``max_bs`` (and ``max_bs``)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def default_max_bs(device_memory_bytes: int, max_running_requests: int) -> int:
    """The largest bucket when not configured: more memory, more concurrent decodes worth
    a graph (at most ``max_running_requests``)."""
    gib = device_memory_bytes / GIB
    cap = 32 if gib < 24 else 64 if gib < 48 else 160 if gib < 80 else 256
    return max(1, min(cap, max_running_requests))


def graphs_unavailable(runner, config) -> str | None:
    """Why decode steps run eagerly on ``runner`` (None: graphs can be used)."""
    if config.disable_cuda_graph:
        return "disabled (disable_cuda_graph)"
    if not str(runner.device).startswith("cuda"):
        return f"device {runner.device} is not a CUDA device"
    if not runner.attn_backend.supports_cuda_graph:
        return f"attention backend {runner.attn_backend.name!r} keeps no static metadata"
    if runner.routes_experts:
        return "a mixture-of-experts model dispatches its tokens on the host"
    if runner.ep is not None:
        return "expert parallelism exchanges tokens on the host"
    return None


class DecodeGraphs:
    """The decode graphs of one model runner (see the module docstring)."""

    def __init__(self, runner, max_bs: int, capture: bool = True):
        self.runner = runner
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.capture = capture
        device = runner.device
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        runner.attn_backend.init_graph_buffers(
            self.max_bs, runner.model.attention_layers()[0].num_heads, runner.dtype)
        self.graphs: dict[int, object] = {}  # bucket -> torch.cuda.CUDAGraph
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> its logits, written by replay
        self.pool = None  # the graphs' shared memory pool
        self.released = False  # the cuda_graph memory tag
        self.largest = LargestDecodeBatch(self.max_bs, "a decode batch of %d requests runs "
                                          "eagerly: the largest CUDA graph bucket is %d (raise "
                                          "cuda_graph_max_bs to capture more)", logger)

    def can_run(self, batch: ForwardBatch) -> bool:
        return not self.released and batch.plain_decode and self.largest.admits(batch)

    def bucket(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The logits of ``batch`` (a decode batch :meth:`can_run` accepted), through its
        bucket's graph (captured first if missing)."""
        n = batch.batch_size
        bs = self.bucket(n)
        if self.capture and bs not in self.graphs:  # dropped (weights moved): capture first,
            self.capture_all()  # it runs padding batches through the same static buffers
        padded = self._padded(batch, bs)
        self.runner.attn_backend.prepare_graph(padded, bs)
        if not self.capture:
            return self.runner.model(padded)[:n]
        self.graphs[bs].replay()
        return self.outputs[bs][:n]

    def _padded(self, batch: ForwardBatch, bs: int) -> ForwardBatch:
        """``batch``'s inputs in the static buffers, padded to ``bs`` rows of padding."""
        n, pad = batch.batch_size, bs - batch.batch_size
        for static, real in ((self.input_ids, batch.input_ids), (self.positions, batch.positions),
                             (self.out_cache_loc, batch.out_cache_loc)):
            static[:n].copy_(real, non_blocking=True)
            static[n:bs].zero_()
        rows = torch.cat((batch.req_rows, torch.zeros(pad, dtype=batch.req_rows.dtype)))
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs],
            positions=self.positions[:bs], out_cache_loc=self.out_cache_loc[:bs],
            req_rows=rows, prefix_lens=batch.prefix_lens + [0] * pad,
            extend_lens=[1] * bs, seq_lens=batch.seq_lens + [1] * pad)

    def _empty_batch(self, bs: int) -> ForwardBatch:
        """``bs`` padding rows: what capture runs (slot 0 through table row 0)."""
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs], req_rows=torch.zeros(bs, dtype=torch.int64),
            prefix_lens=[0] * bs, extend_lens=[1] * bs, seq_lens=[1] * bs)

    def capture_all(self) -> None:
        """Capture every bucket, largest first (the smaller ones reuse its memory)."""
        t0 = time.perf_counter()
        self.input_ids.zero_()
        self.positions.zero_()
        self.out_cache_loc.zero_()
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        with torch.inference_mode():
            for bs in reversed(self.sizes):
                batch = self._empty_batch(bs)
                self.runner.attn_backend.prepare_graph(batch, bs)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up: triton compiles outside capture
                    self.runner.model(batch)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.outputs[bs] = self.runner.model(batch)
                self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s in %.1f s", self.sizes,
                    time.perf_counter() - t0)

    def invalidate(self) -> None:
        """The weights' or the pool's addresses changed: capture again at the next step."""
        if self.graphs:
            logger.info("decode CUDA graphs dropped (weights or KV pool moved); captured "
                        "again at the next decode step")
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None

    def release(self) -> None:
        """The ``cuda_graph`` tag: free the graphs' memory; decode runs eagerly meanwhile."""
        self.invalidate()
        self.released = True
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def resume(self) -> None:
        self.released = False


def build_decode_graphs(runner, config) -> tuple[DecodeGraphs | None, str]:
    """The runner's decode graphs, or None, and what the log says about them."""
    reason = graphs_unavailable(runner, config)
    if reason is not None:
        return None, reason
    total = torch.cuda.get_device_properties(runner.device).total_memory
    max_bs = config.cuda_graph_max_bs or default_max_bs(total, runner.max_running_requests)
    graphs = DecodeGraphs(runner, max_bs)
    return graphs, f"batch sizes up to {graphs.max_bs} ({len(graphs.sizes)} buckets)"
