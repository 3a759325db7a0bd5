"""What the engine's CUDA path does, checked without a GPU: device validation, where batch
tensors and attention indices go (the ``meta`` device stands in for a GPU), the backend choice.
The GPU itself is exercised by tests/gpu."""

from __future__ import annotations

import pytest
import torch

from radixray.engine.attention import TorchAttention, create_attention_backend
from radixray.engine.config import EngineConfig
from radixray.engine.executor.forward_batch import ForwardBatch, ForwardMode
from radixray.engine.mem_cache.pool import KVPool, ReqToTokenPool


def test_device_is_validated():
    assert EngineConfig(device="cuda:1").device == "cuda:1"
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"):
        EngineConfig(device="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without a GPU")
def test_cuda_without_a_gpu_says_so(tiny_llama_dir):
    from radixray import Engine
    with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
        Engine(model=tiny_llama_dir, device="cuda", max_total_tokens=256)


def _pool(device: str) -> KVPool:
    return KVPool(64, num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=device)


def test_auto_backend_reads_pools_off_the_cpu_with_torch():
    table = ReqToTokenPool(4, 32).table
    assert isinstance(create_attention_backend("auto", table, _pool("meta"), 0.5), TorchAttention)
    with pytest.raises(ValueError, match="attention_backend='cpu_paged' needs device='cpu'"):
        create_attention_backend("cpu_paged", table, _pool("meta"), 0.5)


def _batch(mode: ForwardMode) -> ForwardBatch:
    n = 2 if mode is ForwardMode.DECODE else 5
    return ForwardBatch(mode=mode, input_ids=torch.arange(n), positions=torch.arange(n),
                        out_cache_loc=torch.arange(1, n + 1), req_rows=torch.tensor([1, 2]),
                        prefix_lens=[3, 0] if mode is ForwardMode.EXTEND else [3, 4],
                        extend_lens=[2, 3] if mode is ForwardMode.EXTEND else [1, 1],
                        seq_lens=[5, 3] if mode is ForwardMode.EXTEND else [4, 5])


def test_batch_tensors_move_and_request_rows_stay():
    batch = _batch(ForwardMode.EXTEND)
    batch.to_device("meta")
    assert {t.device.type for t in (batch.input_ids, batch.positions, batch.out_cache_loc)} == {"meta"}
    assert batch.req_rows.device.type == "cpu"  # indexes the CPU request table
    assert batch.last_token_rows().device.type == "meta"


def test_attention_indices_go_to_the_pool_device():
    req_pool = ReqToTokenPool(4, 32)
    req_pool.table[1, :5] = torch.arange(10, 15)
    req_pool.table[2, :5] = torch.arange(20, 25)
    backend = TorchAttention(req_pool.table, _pool("meta"), 0.5)
    decode = _batch(ForwardMode.DECODE)
    backend.init_forward_metadata(decode)
    assert decode.attn_metadata["kv_indices"].device.type == "meta"
    assert decode.attn_metadata["kv_mask"].device.type == "meta"  # lengths 4 and 5: padded
    extend = _batch(ForwardMode.EXTEND)
    backend.init_forward_metadata(extend)
    first, second = extend.attn_metadata["prefix_indices"]
    assert first.device.type == "meta" and first.shape == (3,) and second is None
