"""The ``deepep`` expert dispatcher: DeepEP's all-to-all kernels, CUDA only.

DeepEP (github.com/deepseek-ai/DeepEP) moves tokens over NVLink inside a node and RDMA
between nodes. This backend uses its ``deep_ep.Buffer`` API (V1, kept in V2 as the
legacy buffer), imported when a dispatcher is built, so the engine imports without it.
Each dispatcher runs one mode, chosen when it is built, because every rank of the
group must launch the same kernels for a layer:

- normal (throughput, prefill): ``get_dispatch_layout`` -> ``dispatch`` -> the local
  experts -> ``combine``. A token travels once to each rank holding any of its experts;
  that rank returns the weighted sum of its own experts' outputs, and ``combine`` adds
  the per-rank sums at the source.
- low latency (decode): ``low_latency_dispatch`` (bf16: FP8 off, so the experts see the
  model's values) -> each local expert's rows -> ``low_latency_combine``, which weights
  and adds. At most ``num_max_dispatch_tokens_per_rank`` tokens per rank per call, and
  the hidden size must be one DeepEP compiles (2048, 2560, 3072, 4096, 5120, 6144,
  7168, 8192).

Hidden states must be bf16 on CUDA. The result is not bit-equal to LocalExperts: the
k products of a token are summed per rank first and DeepEP's combine adds those sums
in its own order, so the contract's "added in increasing slot order" does not hold.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from radixray.engine.ep.dispatch import ExpertShard
from radixray.kernels.cpu_ops import CpuKernels

_BUFFERS: dict[tuple, object] = {}


def _deep_ep():
    try:
        import deep_ep
    except ImportError as exc:
        raise ImportError("ep_dispatch_backend 'deepep' needs DeepEP (the deep_ep package, "
                          "CUDA only, not on PyPI): build it from source with NVSHMEM "
                          "(github.com/deepseek-ai/DeepEP) next to radixray[gpu], or use "
                          "ep_dispatch_backend 'collectives'") from exc
    return deep_ep


def _shared_buffer(deep_ep, group: dist.ProcessGroup, world_size: int, hidden_size: int,
                   num_experts: int, low_latency: bool, num_max_tokens: int):
    """One ``deep_ep.Buffer`` per process group and mode, shared by every MoE layer, sized
    as DeepEP's README does: its buffers are large registered memory, allocated once."""
    buffer_cls = deep_ep.Buffer
    if low_latency:
        nvl = 0
        rdma = buffer_cls.get_low_latency_rdma_size_hint(num_max_tokens, hidden_size,
                                                         world_size, num_experts)
    else:
        hidden_bytes = hidden_size * 2  # bf16 rows
        nvl = rdma = 0
        for config in (buffer_cls.get_dispatch_config(world_size),
                       buffer_cls.get_combine_config(world_size)):
            nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, world_size))
            rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, world_size))
    key = (group, low_latency)
    buffer = _BUFFERS.get(key)
    if buffer is None or buffer.num_nvl_bytes < nvl or buffer.num_rdma_bytes < rdma:
        if low_latency:  # DeepEP: one queue pair per local expert performs best
            buffer = buffer_cls(group, 0, rdma, low_latency_mode=True,
                                num_qps_per_rank=num_experts // world_size)
        else:
            buffer = buffer_cls(group, nvl, rdma)
        _BUFFERS[key] = buffer
    return buffer


class DeepEPExperts(ExpertShard):
    """Expert parallelism over DeepEP (see the module docstring for the two modes).

    Slots and parameters as :class:`~.ep_dispatch.ExpertShard`: rank ``r`` holds
    ``[r * S, (r + 1) * S)``, which is DeepEP's own expert layout. ImportError naming
    the ``gpu`` extra when DeepEP is not installed.
    """

    def __init__(self, num_physical: int, rank: int, world_size: int, hidden_size: int,
                 intermediate_size: int, kernels: CpuKernels,
                 group: dist.ProcessGroup | None = None, low_latency: bool = False,
                 num_max_dispatch_tokens_per_rank: int = 128):
        super().__init__(num_physical, rank, world_size, hidden_size, intermediate_size, kernels)
        self._ep = _deep_ep()
        self.group = group  # also moves expert weights in a rebalance (engine/ep/expert_moves.py)
        self.low_latency = low_latency
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.buffer = _shared_buffer(self._ep, group or dist.group.WORLD, world_size,
                                     hidden_size, num_physical, low_latency,
                                     num_max_dispatch_tokens_per_rank)

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        if hidden.dtype != torch.bfloat16 or not hidden.is_cuda:
            raise TypeError(f"ep_dispatch_backend 'deepep' moves bf16 CUDA tensors, got "
                            f"{hidden.dtype} on {hidden.device}")
        hidden = hidden.contiguous()
        topk_idx = topk_ids.to(self._ep.topk_idx_t)
        weights = topk_weights.float()
        if self.low_latency:
            return self._dispatch_low_latency(hidden, topk_idx, weights)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
            topk_idx, self.num_physical)
        recv_x, recv_idx, recv_weights, _, handle, _ = self.buffer.dispatch(
            hidden, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert)
        combined, _, _ = self.buffer.combine(self._local_sums(recv_x, recv_idx, recv_weights),
                                             handle)
        return combined

    def _local_sums(self, recv_x: torch.Tensor, recv_idx: torch.Tensor,
                    recv_weights: torch.Tensor) -> torch.Tensor:
        """Each received token's weighted sum over this rank's experts. DeepEP gives local
        expert ids, -1 where the token's expert lives elsewhere."""
        rows, cols = (recv_idx >= 0).nonzero(as_tuple=True)
        outputs = self.expert_outputs(recv_x[rows], recv_idx[rows, cols])
        products = (outputs * recv_weights[rows, cols, None]).to(recv_x.dtype)
        return torch.zeros_like(recv_x).index_add_(0, rows, products)

    def _dispatch_low_latency(self, hidden: torch.Tensor, topk_idx: torch.Tensor,
                              weights: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] > self.num_max_dispatch_tokens_per_rank:
            raise ValueError(f"low-latency DeepEP takes at most num_max_dispatch_tokens_per_rank "
                             f"({self.num_max_dispatch_tokens_per_rank}) tokens, got "
                             f"{hidden.shape[0]}")
        recv_x, recv_count, handle, _, _ = self.buffer.low_latency_dispatch(
            hidden, topk_idx, self.num_max_dispatch_tokens_per_rank, self.num_physical,
            use_fp8=False)
        # recv_x [S, max_tokens * world_size, H]: expert e's rows are recv_x[e, :count[e]]
        out = torch.zeros_like(recv_x)
        for e, n in enumerate(recv_count.tolist()):  # a host sync: not CUDA-graph safe
            if n:
                ids = torch.full((n,), e, dtype=torch.long, device=recv_x.device)
                out[e, :n] = self.expert_outputs(recv_x[e, :n], ids)
        combined, _, _ = self.buffer.low_latency_combine(out, topk_idx, weights, handle)
        return combined
