"""The GPU attention backends, decode CUDA graphs and the fused MoE kernel on a CUDA device
(skipped without one).

fp32: the triton backend's greedy tokens equal Hugging Face's in every mode (alone,
batched, radix-cache hit, chunked prefill); flashinfer refuses an fp32 pool. bf16: their tokens equal the torch
(SDPA) backend's until a divergence, which may only fall on a near-tie of the reference's
top-2 logprobs. Decode CUDA graphs on, capped below the batch, and off give the same greedy
tokens for batches of 1, 3 and 17 requests that finish at different steps (the batch
shrinks through the graph buckets). A tiny Qwen3-MoE (the fused triton MoE kernel on CUDA)
equals Hugging Face in fp32.
"""

from __future__ import annotations

import random

import pytest
import torch
from model_fixtures import (
    NEAR_TIE,
    assert_greedy_equal,
    hf_greedy,
    random_prompts,
    run_all_modes,
)

pytestmark = pytest.mark.gpu

BACKENDS = ["triton", "flashinfer"]
BF16_NEW = 16
BF16_NEAR_TIE = 0.1  # top-2 logprob gap under which bf16 rounding may flip the argmax
BF16_PARAMS = {"temperature": 0.0, "max_new_tokens": BF16_NEW, "ignore_eos": True,
               "return_logprob": True, "top_logprobs_num": 2}
GRAPH_BATCHES = (1, 3, 17)
GRAPH_MODES = {"graphs": {}, "graphs-max-bs-8": {"cuda_graph_max_bs": 8},
               "no-graphs": {"disable_cuda_graph": True}}


def _need(backend: str) -> None:
    pytest.importorskip("flashinfer" if backend == "flashinfer" else "triton")


def _need_graph_options() -> None:
    from radixray.engine.config import EngineConfig
    missing = {"disable_cuda_graph", "cuda_graph_max_bs"} - set(EngineConfig.__dataclass_fields__)
    if missing:
        pytest.skip(f"this engine has no {sorted(missing)} options yet")


def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda").eval()


@pytest.fixture(scope="module")
def hf_llama(tiny_llama_dir):
    return _hf(tiny_llama_dir)


# ---- fp32: the triton backend equals Hugging Face; flashinfer refuses fp32 ----------------
def test_fp32_triton_backend_matches_hf_in_every_mode(tiny_llama_dir, hf_llama):
    _need("triton")
    run_all_modes(tiny_llama_dir, random_prompts(hf_llama.config.vocab_size), hf_llama,
                  "llama/cuda/triton", device="cuda", attention_backend="triton")


def test_flashinfer_refuses_an_fp32_pool_naming_what_to_use(tiny_llama_dir):
    _need("flashinfer")
    from radixray import Engine
    with pytest.raises(ValueError, match="flashinfer.*16-bit"):
        Engine(model=tiny_llama_dir, device="cuda", dtype="float32",
               attention_backend="flashinfer", max_total_tokens=1024)


# ---- bf16: each backend equals the torch backend up to near-ties --------------------------
def _bf16_outputs(model_dir: str, backend: str, prompts: list[list[int]], **options):
    """Greedy bf16 outputs with top-2 logprobs: each prompt alone, then all batched."""
    from radixray import Engine
    with Engine(model=model_dir, device="cuda", dtype="bfloat16", attention_backend=backend,
                max_total_tokens=4096, check_kv_conservation=True, **options) as eng:
        assert eng.runner.attn_backend.name == backend
        alone = [eng.generate(input_ids=p, sampling_params=BF16_PARAMS) for p in prompts]
        eng.flush_cache()
        batch = eng.generate(input_ids=prompts, sampling_params=BF16_PARAMS)
        eng.check_kv_conservation()
    return alone, batch


def assert_bf16_close(ours: dict, ref: dict, label: str) -> int:
    """Equal tokens up to the first divergence, which must be a near-tie of ``ref``'s top-2
    logprobs (then the sequences differ after it). Returns how many tokens matched."""
    for i, (a, b) in enumerate(zip(ours["output_ids"], ref["output_ids"])):
        if a != b:
            top = ref["output_top_logprobs"][i]
            gap = top[0][1] - top[1][1]
            assert gap < BF16_NEAR_TIE, (f"{label}: token {i} differs: {a} vs reference {b} "
                                         f"(reference top-2 gap {gap:.3f})\nours={ours['output_ids']}"
                                         f"\nref ={ref['output_ids']}")
            print(f"[bf16 near-tie] {label}: step {i} ours={a} ref={b} gap={gap:.3f}")
            return i
    assert len(ours["output_ids"]) == len(ref["output_ids"]) == BF16_NEW, label
    return BF16_NEW


@pytest.fixture(scope="module")
def bf16_reference(tiny_llama_dir, hf_llama):
    prompts = random_prompts(hf_llama.config.vocab_size)
    alone, _ = _bf16_outputs(tiny_llama_dir, "torch", prompts)
    return prompts, alone


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_backend_matches_torch_backend(backend, tiny_llama_dir, bf16_reference):
    _need(backend)
    prompts, ref = bf16_reference
    alone, batch = _bf16_outputs(tiny_llama_dir, backend, prompts)
    matched = 0
    for mode, outs in (("alone", alone), ("batch", batch)):
        for i, (out, want) in enumerate(zip(outs, ref)):
            matched += assert_bf16_close(out, want, f"bf16 {backend} {mode} prompt {i}")
    # near-ties are rare: most tokens match (a kernel that is wrong everywhere cannot hide)
    assert matched >= 0.75 * 2 * len(prompts) * BF16_NEW, f"only {matched} tokens matched"


# ---- decode CUDA graphs: on, capped, off ---------------------------------------------------
def _graph_workload(vocab: int, n: int, seed: int):
    """``n`` prompts of 3-70 tokens and per-request token budgets 14-32, so requests finish
    at different steps and the decode batch shrinks through the graph buckets."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(3, 70))] for _ in range(n)]
    budgets = [32 - 6 * (i % 4) for i in range(n)]
    return prompts, budgets


def _graph_outputs(model_dir: str, dtype: str, workloads, params_extra: dict, **options):
    from radixray import Engine
    outs = []
    with Engine(model=model_dir, device="cuda", dtype=dtype, attention_backend="triton",
                max_total_tokens=8192, check_kv_conservation=True, **options) as eng:
        runner = eng.runner
        assert runner.attn_backend.name == "triton"
        graphs = runner.decode_graphs
        if options.get("disable_cuda_graph"):
            assert graphs is None
        else:  # captured at start-up, up to the cap when one is set
            assert graphs is not None
            assert graphs.sizes[-1] == options.get("cuda_graph_max_bs", graphs.sizes[-1])
        for prompts, budgets in workloads:
            params = [{"temperature": 0.0, "max_new_tokens": b, "ignore_eos": True,
                       **params_extra} for b in budgets]
            outs.append(eng.generate(input_ids=prompts, sampling_params=params))
            eng.flush_cache()
        eng.check_kv_conservation()
    return outs


def test_cuda_graphs_on_capped_and_off_give_the_same_greedy_tokens(tiny_llama_dir, hf_llama):
    pytest.importorskip("triton")
    _need_graph_options()
    vocab = hf_llama.config.vocab_size
    workloads = [_graph_workload(vocab, n, seed=n) for n in GRAPH_BATCHES]
    refs = [[hf_greedy(hf_llama, p, b) for p, b in zip(*w)] for w in workloads]
    results = {mode: _graph_outputs(tiny_llama_dir, "float32", workloads, {}, **options)
               for mode, options in GRAPH_MODES.items()}
    eager = results["no-graphs"]
    for mode, outs in results.items():
        for n, batch_outs, batch_refs, batch_eager in zip(GRAPH_BATCHES, outs, refs, eager):
            for i, (out, (ref, gaps), base) in enumerate(zip(batch_outs, batch_refs,
                                                               batch_eager)):
                label = f"fp32 {mode} batch {n} request {i}"
                assert_greedy_equal(out["output_ids"], ref, gaps, label + " vs HF")
                # both equal HF up to a near-tie: identical unless one took the other branch
                if out["output_ids"] != base["output_ids"]:
                    assert min(gaps) < NEAR_TIE, f"{label}: differs from no-graphs"


def test_cuda_graphs_bf16_match_eager_up_to_near_ties(tiny_llama_dir, hf_llama):
    pytest.importorskip("triton")
    _need_graph_options()
    workloads = [_graph_workload(hf_llama.config.vocab_size, 17, seed=117)]
    with_logprobs = {"return_logprob": True, "top_logprobs_num": 2}
    graphs = _graph_outputs(tiny_llama_dir, "bfloat16", workloads, with_logprobs)[0]
    eager = _graph_outputs(tiny_llama_dir, "bfloat16", workloads, with_logprobs,
                           disable_cuda_graph=True)[0]
    for i, (out, ref) in enumerate(zip(graphs, eager)):
        # near-tie rule of assert_bf16_close, over each request's own budget
        for step, (a, b) in enumerate(zip(out["output_ids"], ref["output_ids"])):
            if a != b:
                top = ref["output_top_logprobs"][step]
                gap = top[0][1] - top[1][1]
                assert gap < BF16_NEAR_TIE, f"bf16 graphs request {i} step {step}: gap {gap:.3f}"
                break
        assert len(out["output_ids"]) == len(ref["output_ids"])


# ---- the fused MoE kernel -------------------------------------------------------------------
def test_qwen3_moe_matches_hf_on_cuda(tiny_qwen3_moe_dir):
    hf = _hf(tiny_qwen3_moe_dir)
    run_all_modes(tiny_qwen3_moe_dir, random_prompts(hf.config.vocab_size), hf,
                  "qwen3_moe/cuda", device="cuda")
