"""Expert-parallel dispatchers: every rank's output equals LocalExperts over the full
weights on that rank's tokens, whatever the ranks hold and send.

Ranks are processes (torch.multiprocessing, gloo on 127.0.0.1); the rendezvous store
listens on a port the kernel picks, and every wait has a deadline so a hang fails.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from radixray.engine.ep.dispatch import (
    CollectivesExperts,
    ExpertShard,
    a2a_bytes_per_token,
)
from radixray.engine.ep.factory import make_expert_dispatcher
from radixray.engine.models.experts import LocalExperts
from radixray.kernels.cpu_ops import BatchInvariantKernels, CpuKernels, load_extension

HIDDEN, INTER, TOP_K = 32, 16, 3
DEADLINE_S = 90.0

# Ranks fork from a server process that imported these once (a fresh interpreter per
# rank spends ~3 s importing torch); the server itself is fresh, so no threads are forked.
mp.get_context("forkserver").set_forkserver_preload(
    ["torch", "torch.distributed", "radixray.engine.ep.dispatch", __name__])


def _run_ranks(fn, world_size: int, *args, start_method: str = "forkserver") -> None:
    """Run ``fn(rank, world_size, store_port, *args)`` in ``world_size`` processes; a
    failure in any re-raises here, and ranks still running at the deadline are killed."""
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    ctx = mp.start_processes(fn, args=(world_size, store.port, *args), nprocs=world_size,
                             join=False, start_method=start_method)
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{world_size} ranks still running after {DEADLINE_S} s")
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
                process.join()


def _init(rank: int, world_size: int, port: int, backend: str = "gloo") -> None:
    torch.set_num_threads(1)  # the ranks share a small machine
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)


def _weights(num_physical: int, hidden_size: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(num_physical, 2 * inter, hidden_size, generator=g) / hidden_size ** 0.5
    down = torch.randn(num_physical, hidden_size, inter, generator=g) / inter ** 0.5
    return gate_up, down


def _batch(rank: int, num_tokens: int, num_physical: int, slots: range | None = None,
           hidden_size: int = HIDDEN):
    """Rank ``rank``'s tokens: random hidden rows, k distinct slots each (drawn from
    ``slots`` when given, else from all), softmax weights in fp32."""
    g = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(num_tokens, hidden_size, generator=g)
    pool = torch.tensor(list(slots if slots is not None else range(num_physical)))
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:TOP_K]]
                       for _ in range(num_tokens)]) if num_tokens else \
        torch.empty(0, TOP_K, dtype=torch.long)
    weights = torch.softmax(torch.randn(num_tokens, TOP_K, generator=g), dim=-1)
    return hidden, ids, weights


def _tokens_per_rank(world_size: int) -> list[int]:
    """Different batch sizes, the last rank with none."""
    return [5 + 7 * r for r in range(world_size - 1)] + [0]


def _pair(backend: str, kernels: CpuKernels, rank: int, world_size: int, num_physical: int,
          hidden_size: int = HIDDEN, inter: int = INTER, **options):
    """This rank's share (from the ``backend`` dispatcher) and the full LocalExperts
    reference, from the same weights."""
    gate_up, down = _weights(num_physical, hidden_size, inter)
    ep = make_expert_dispatcher(backend, num_physical, hidden_size, inter, kernels, rank=rank,
                                world_size=world_size, **options)
    full = LocalExperts(num_physical, hidden_size, inter, kernels)
    mine = slice(ep.local_slots.start, ep.local_slots.stop)
    with torch.no_grad():
        ep.gate_up_proj.copy_(gate_up[mine])
        ep.down_proj.copy_(down[mine])
        full.gate_up_proj.copy_(gate_up)
        full.down_proj.copy_(down)
    return ep, full


def _expected_bytes(rank: int, world_size: int, batches: list, slots_per_rank: int,
                    row: int) -> tuple[int, int]:
    """(dispatch, combine) bytes rank ``rank`` sends to other ranks for ``batches``."""
    mine = batches[rank][1] // slots_per_rank
    sent_away = int((mine != rank).sum())
    received = sum(int((b[1] // slots_per_rank == rank).sum())
                   for r, b in enumerate(batches) if r != rank)
    return (world_size - 1) * 8 + sent_away * (row + 4), received * row


def _equal_to_local_experts(rank: int, world_size: int, exact_fp32: bool) -> None:
    num_physical = 4 * world_size
    batches = [_batch(r, n, num_physical) for r, n in enumerate(_tokens_per_rank(world_size))]
    fp32_kernels = BatchInvariantKernels() if exact_fp32 else CpuKernels(enabled=False)
    cases = [(torch.float32, torch.float32, fp32_kernels),
             (torch.bfloat16, torch.float32, CpuKernels(enabled=False)),  # Mixtral: fp32 weights
             (torch.bfloat16, torch.bfloat16, CpuKernels(enabled=False))]  # Qwen-MoE
    for dtype, weight_dtype, kernels in cases:
        ep, full = (m.to(dtype) for m in _pair("collectives", kernels, rank, world_size,
                                               num_physical))
        hidden, ids, weights = batches[rank]
        hidden, weights = hidden.to(dtype), weights.to(weight_dtype)
        with torch.no_grad():
            out = ep.dispatch(hidden, ids, weights)
            expected = full.dispatch(hidden, ids, weights)
        assert out.dtype == dtype and out.shape == hidden.shape
        if dtype == torch.float32 and exact_fp32:
            assert torch.equal(out, expected)
        else:
            # a few bf16 ulps at these outputs' scale (~0.5)
            torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1e-2)
        counters = ep.counters
        assert counters.calls == 1 and counters.seconds > 0
        row = HIDDEN * hidden.element_size()
        assert (counters.dispatch_bytes, counters.combine_bytes) == \
            _expected_bytes(rank, world_size, batches, ep.slots_per_rank, row)
        assert counters.bytes_sent > 0


def _all_pairs_remote(rank: int, world_size: int) -> None:
    """Rank 0's tokens pick only rank 1's slots and rank 1 has none: the bytes each side
    sends are the per-token formula times the tokens, plus the counts."""
    num_physical, num_tokens = 8, 6
    ep = _pair("collectives", CpuKernels(enabled=False), rank, world_size,
               num_physical)[0].bfloat16()
    hidden, ids, weights = _batch(rank, num_tokens if rank == 0 else 0, num_physical,
                                  slots=range(4, 8))
    with torch.no_grad():
        out = ep.dispatch(hidden.bfloat16(), ids, weights)
    assert out.shape == (hidden.shape[0], HIDDEN)
    dispatch, combine = a2a_bytes_per_token(HIDDEN, TOP_K, torch.bfloat16)
    expected = (8 + num_tokens * dispatch, 0) if rank == 0 else (8, num_tokens * combine)
    assert (ep.counters.dispatch_bytes, ep.counters.combine_bytes) == expected


def _rank_main(rank: int, world_size: int, port: int, exact_fp32: bool) -> None:
    _init(rank, world_size, port)
    _equal_to_local_experts(rank, world_size, exact_fp32)
    if world_size == 2:  # here rather than in a test of its own: a spawn costs seconds
        _all_pairs_remote(rank, world_size)
    dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_across_ranks(world_size):
    """Each rank's output equals LocalExperts on its tokens: bit-equal in fp32 through
    the batch-invariant kernels, within bf16 rounding otherwise (the expert rank runs a
    slot's GEMM on every rank's rows at once, and BLAS may round another row count
    differently). The byte counters match the exchange, and with two ranks the
    per-token formula does."""
    _run_ranks(_rank_main, world_size, load_extension() is not None)


def test_bytes_per_token_formula():
    # DeepSeek-V3 shape, bf16: each of 8 pairs sends a 7168 * 2 byte row plus a 4 byte id
    # and gets a row back.
    assert a2a_bytes_per_token(7168, 8, torch.bfloat16) == (8 * (14336 + 4), 8 * 14336)
    assert a2a_bytes_per_token(32, 2, torch.float32) == (2 * (128 + 4), 2 * 128)


def test_single_rank_collectives_has_every_slot():
    """One rank holds every slot and still runs the exchange with itself."""
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ep, full = _pair("collectives", CpuKernels(enabled=False), 0, 1, 4)
        hidden, ids, weights = _batch(0, 9, 4)
        assert ep.local_slots == range(0, 4)
        assert torch.equal(ep.dispatch(hidden, ids, weights), full.dispatch(hidden, ids, weights))
        assert ep.counters.bytes_sent == 0  # nothing left the process
        with pytest.raises(ValueError, match="past num_physical"):
            ep.dispatch(hidden, ids + 1, weights)  # some token now picks slot 4 of 0..3
    finally:
        dist.destroy_process_group()


def test_factory_backends_and_errors():
    kernels = CpuKernels(enabled=False)
    local = make_expert_dispatcher("local", 8, HIDDEN, INTER, kernels)
    assert type(local) is LocalExperts and local.gate_up_proj.shape == (8, 2 * INTER, HIDDEN)
    shard = make_expert_dispatcher("collectives", 8, HIDDEN, INTER, kernels, rank=1,
                                   world_size=2)
    assert isinstance(shard, CollectivesExperts) and shard.local_slots == range(4, 8)
    assert shard.gate_up_proj.shape == (4, 2 * INTER, HIDDEN)
    assert shard.down_proj.shape == (4, HIDDEN, INTER)
    assert [name for name, _ in shard.named_parameters()] == ["gate_up_proj", "down_proj"]
    with pytest.raises(ValueError, match="ep_dispatch_backend"):
        make_expert_dispatcher("nccl", 8, HIDDEN, INTER, kernels)
    with pytest.raises(ValueError, match="ep_dispatch_backend 'local'"):
        make_expert_dispatcher("local", 8, HIDDEN, INTER, kernels, world_size=2)
    with pytest.raises(ValueError, match="divisible by ep_size"):
        make_expert_dispatcher("collectives", 6, HIDDEN, INTER, kernels, rank=0, world_size=4)
    with pytest.raises(TypeError):
        ExpertShard(8, 0, 2, HIDDEN, INTER, kernels)  # abstract: no exchange of its own


def test_deepep_without_the_package_names_the_extra(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"deepseek-ai/DeepEP"):
        make_expert_dispatcher("deepep", 8, HIDDEN, INTER, CpuKernels(enabled=False),
                               rank=0, world_size=2)


def _deepep_rank(rank: int, world_size: int, port: int, low_latency: bool) -> None:
    torch.cuda.set_device(rank)
    _init(rank, world_size, port, "nccl")
    num_physical, num_tokens = 4 * world_size, 16 if rank == 0 else 0
    ep, full = _pair("deepep", CpuKernels(enabled=False), rank, world_size, num_physical,
                     hidden_size=2048, inter=256,  # a hidden size DeepEP compiles
                     low_latency=low_latency)
    ep, full = ep.to("cuda", torch.bfloat16), full.to("cuda", torch.bfloat16)
    hidden, ids, weights = (t.cuda() for t in _batch(rank, num_tokens, num_physical,
                                                      hidden_size=2048))
    hidden = hidden.bfloat16()
    with torch.no_grad():
        out, expected = ep.dispatch(hidden, ids, weights), full.dispatch(hidden, ids, weights)
    torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=1e-2)
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("low_latency", [False, True])
def test_deepep_equal_local_experts(low_latency):
    """Within bf16 rounding: DeepEP sums per-rank partials in its own order. Checked here,
    not at import, so the rank server never touches CUDA before it forks."""
    if torch.cuda.device_count() < 2:
        pytest.skip("DeepEP needs 2 CUDA devices")
    pytest.importorskip("deep_ep")
    _run_ranks(_deepep_rank, 2, low_latency, start_method="spawn")  # CUDA does not survive fork
