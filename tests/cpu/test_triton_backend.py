"""``attention_backend="triton"`` end to end through the engine on the CPU, the kernels run by
triton's interpreter (``TRITON_INTERPRET=1``, slow: short generations). On a tiny random
Llama with GQA the engine's greedy tokens equal Hugging Face's for prompts alone, batched
(decode over ragged lengths), from the radix cache (extend over a cached prefix) and with
chunked prefill; every KV slot is accounted for. The kernels themselves are checked against
their torch references in test_triton_attention.py."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

import pytest  # noqa: E402
import torch  # noqa: E402
from model_fixtures import assert_greedy_equal, hf_greedy, random_prompts  # noqa: E402

from radixray import Engine  # noqa: E402

pytest.importorskip("triton")
NEW_TOKENS = 6
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def refs(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompts = random_prompts(350)[3:7]  # 17, 25, 33 and 48 tokens; two share a 20-token prefix
    return prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


def _check(outs, refs, mode):
    for i, (out, (ref, gaps)) in enumerate(zip(outs, refs)):
        assert_greedy_equal(out["output_ids"], ref, gaps, f"triton {mode} prompt {i}")


def test_triton_backend_greedy_equals_hf(tiny_llama_dir, refs):
    prompts, want = refs
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=1024,
                attention_backend="triton", check_kv_conservation=True) as eng:
        assert eng.runner.attn_backend.name == "triton"
        _check(eng.generate(input_ids=prompts, sampling_params=GREEDY), want, "batch")
        cached = eng.generate(input_ids=prompts, sampling_params=GREEDY)
        _check(cached, want, "radix-cache hit")
        assert [o["meta_info"]["cached_tokens"] for o in cached] == [len(p) - 1 for p in prompts]
        eng.check_kv_conservation()


def test_triton_backend_with_chunked_prefill_equals_hf(tiny_llama_dir, refs):
    prompts, want = refs
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=1024,
                attention_backend="triton", chunked_prefill_size=16) as eng:
        _check(eng.generate(input_ids=prompts, sampling_params=GREEDY), want, "chunked-16")


def test_gpu_backends_say_what_they_need_on_the_cpu(monkeypatch):
    """Without the interpreter the triton backend refuses a CPU pool naming the variable;
    flashinfer refuses it naming the backends that run there; auto on the CPU stays off
    both (cpu_paged or torch)."""
    from radixray.engine.attention import create_attention_backend
    from radixray.engine.attention.triton_backend import triton_usable
    from radixray.engine.mem_cache.pool import KVPool
    pool = KVPool(8, 1, 2, 16, torch.float32)
    table = torch.zeros(2, 8, dtype=torch.int64)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "TRITON_INTERPRET=1" in triton_usable(torch.device("cpu"))
    with pytest.raises(ValueError, match="attention_backend='triton'.*CUDA"):
        create_attention_backend("triton", table, pool, 0.25)
    with pytest.raises(ValueError, match="attention_backend='flashinfer' runs on CUDA"):
        create_attention_backend("flashinfer", table, pool, 0.25)
    assert create_attention_backend("auto", table, pool, 0.25).name in ("cpu_paged", "torch")


def test_decode_graph_buckets():
    from radixray.engine.executor.cuda_graph import capture_sizes, default_max_bs
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    assert default_max_bs(141 * 2**30, 4096) == 256 and default_max_bs(16 * 2**30, 4096) == 32
    assert default_max_bs(141 * 2**30, 12) == 12


def test_decode_graph_static_path_equals_hf(tiny_llama_dir, refs):
    """The decode-graph path without capture (what a GPU captures and replays): inputs in
    static buffers, batches padded to their bucket (3 requests -> bucket 4, then 2 -> 2,
    then 1 as the others finish), the triton backend's page table in static buffers with a
    fixed split count. Greedy tokens equal Hugging Face's; every slot is accounted for."""
    from radixray.engine.executor.cuda_graph import DecodeGraphs
    prompts, want = refs
    lengths = {"temperature": 0.0, "ignore_eos": True}
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=1024,
                attention_backend="triton", check_kv_conservation=True) as eng:
        runner = eng.runner
        assert runner.decode_graphs is None  # on the CPU: eager, with the reason logged
        runner.decode_graphs = DecodeGraphs(runner, 4, capture=False)
        params = [{**lengths, "max_new_tokens": n} for n in (NEW_TOKENS, 4, 2)]
        outs = eng.generate(input_ids=prompts[:3], sampling_params=params)
        for i, (out, n) in enumerate(zip(outs, (NEW_TOKENS, 4, 2))):
            ref, gaps = want[i]
            assert_greedy_equal(out["output_ids"], ref[:n], gaps, f"graph path prompt {i}")
        assert runner.last_step_graphed
        eng.check_kv_conservation()
