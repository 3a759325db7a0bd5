"""Compiled decode (``enable_torch_compile``): the eager step's tokens and logprobs, bit for bit.

On a tiny random Llama (fp32, and the int8 path): one workload whose decode batches shrink
from 8 requests to 1 as requests of different lengths finish, run eagerly and compiled,
gives identical token ids and identical logprobs; the compiled runs trace two graphs
(batch 1 and batch 2..max; the int8 path one more, where its GEMM changes kernel) and
nothing more as batches and contexts change; a batch above
``torch_compile_max_bs`` runs eagerly and says so once; compiled code lands in the
inductor cache folder; and what the compiled step does not cover is named.
"""

from __future__ import annotations

import logging
import os

import pytest
from model_fixtures import random_prompts

from radixray import Engine
from radixray.engine.config import EngineConfig
from radixray.engine.executor.compiled_decode import (
    compile_unavailable,
    inductor_cache_dir,
    use_inductor_cache,
)


def _workload(vocab: int) -> tuple[list[list[int]], list[dict]]:
    """Eight prompts of 3-70 tokens; outputs of 4-21 tokens, so the decode batch shrinks step
    by step through sizes 8 .. 1 with every context length different."""
    prompts = random_prompts(vocab)
    params = [{"temperature": 0.0, "max_new_tokens": 4 + 2 * i + (i % 3), "ignore_eos": True,
               "return_logprob": True} for i in range(len(prompts))]
    return prompts, params


def _run(model_dir: str, **options) -> tuple[list, list, Engine]:
    with Engine(model=model_dir, dtype="float32", max_total_tokens=4096,
                check_kv_conservation=True, **options) as engine:
        prompts, params = _workload(engine.limits.vocab_size)
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        alone = engine.generate(input_ids=prompts[3], sampling_params=params[3])
        traced = _graphs()
        again = engine.generate(input_ids=[p + [7] for p in prompts], sampling_params=params)
        engine.retraced = _graphs() - traced  # a second wave at other lengths
        assert [len(o["output_ids"]) for o in again] == [p["max_new_tokens"] for p in params]
        engine.check_kv_conservation()
    ids = [o["output_ids"] for o in outs] + [alone["output_ids"]]
    logprobs = [o["output_token_logprobs"] for o in outs + [alone]]
    return ids, logprobs, engine


def _graphs() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("quant", [None, pytest.param("w8a8_int8", marks=pytest.mark.slow)])
def test_compiled_decode_equals_eager_at_every_batch_size(tiny_llama_dir, quant, caplog):
    options = {"quantization": quant, "quantize_lm_head": quant is not None}
    eager_ids, eager_lp, _ = _run(tiny_llama_dir, **options)
    before = _graphs()
    with caplog.at_level(logging.INFO, logger="radixray.engine.executor.compiled_decode"):
        ids, lp, engine = _run(tiny_llama_dir, enable_torch_compile=True, torch_compile_max_bs=6,
                               **options)
    assert engine.runner.compiled_decode is not None
    assert ids == eager_ids
    assert lp == eager_lp  # the same floats, not merely close
    # batch 1 and batch 2..6; on AVX2 the int8 GEMM changes kernel at 4 rows (SMALL_M_MAX),
    # which splits 2..6 as eager does (VNNI and AMX keep one kernel up to 64 rows); a second
    # wave at other lengths and batch sizes traces nothing new
    from radixray.engine.precision import int8_kernel_kind
    split = quant is not None and int8_kernel_kind() == "avx2"
    assert _graphs() - before == (3 if split else 2)
    assert engine.retraced == 0
    text = caplog.text
    assert "compiled the decode step for batch sizes 1..6" in text
    # batches of 8 and 7 ran eagerly, logged once with the reason
    assert text.count("runs eagerly: the compiled decode step covers up to 6") == 1
    # what a restart reuses
    assert any(files for _, _, files in os.walk(os.environ["TORCHINDUCTOR_CACHE_DIR"]))


def test_a_restart_with_another_kv_pool_size_reuses_the_compiled_graphs(tiny_llama_dir):
    """The pool's token count (sized by the memory free at start) is no constant of the
    graphs: an engine with a pool of another size finds both graphs in inductor's cache."""
    import random

    from torch._dynamo.utils import counters

    def compile_with(pool: int) -> dict:
        before = dict(counters["inductor"])
        with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=pool,
                    enable_torch_compile=True, torch_compile_max_bs=4) as engine:
            assert engine.runner.compiled_decode is not None
        return {k: counters["inductor"][k] - before.get(k, 0)
                for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}
    compile_with(4096)
    other = compile_with(4096 + 16 * random.randrange(1, 4096))  # a size no earlier run had
    assert other == {"fxgraph_cache_hit": 2, "fxgraph_cache_miss": 0}


def test_inductor_cache_goes_to_radixrays_folder_unless_the_user_chose_one(monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    use_inductor_cache(inductor_cache_dir())
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == inductor_cache_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    use_inductor_cache("/tmp/radixray-inductor-test")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/radixray-inductor-test"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/data/mine")
    use_inductor_cache(inductor_cache_dir())
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/data/mine"


def test_what_compiled_decode_does_not_cover_is_named(tiny_llama_dir):
    class Runner:  # the attributes compile_unavailable reads
        device, routes_experts = "cpu", False

        class attn_backend:
            name = "cpu_paged"

        class kernels:
            active = True

        class tp:
            size = 1

    assert compile_unavailable(Runner, EngineConfig(enable_torch_compile=True)) is None
    assert "off" in compile_unavailable(Runner, EngineConfig())
    assert "deterministic" in compile_unavailable(
        Runner, EngineConfig(enable_torch_compile=True, deterministic=True))
    assert "prefill worker" in compile_unavailable(
        Runner, EngineConfig(enable_torch_compile=True, disaggregation_mode="prefill"))
    Runner.routes_experts = True
    assert "mixture-of-experts" in compile_unavailable(Runner, EngineConfig(
        enable_torch_compile=True))
    Runner.routes_experts, Runner.attn_backend.name = False, "torch"
    assert "'torch'" in compile_unavailable(Runner, EngineConfig(enable_torch_compile=True))
    with pytest.raises(ValueError, match="torch_compile_max_bs"):
        EngineConfig(torch_compile_max_bs=0)
