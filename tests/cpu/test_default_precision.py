"""The default precision (engine/precision.py): what ``quantization="auto"`` becomes, and its cost.

- Where the fast default applies and where it does not (each case named in the reason),
  and an explicit choice used as given; ``exact`` with an explicit quantization refused.
- The default model as a new user starts it: int8 weights and lm_head, fp8 KV, logged;
  ``exact=true`` the unquantized fp32 path.
- Its quality against ``--exact`` within the bounds radixray/bench/default_quality.py states
  (perplexity of the README, greedy agreement over 32 prompts).
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest

from radixray.engine.config import EngineConfig
from radixray.engine.precision import EXACT_ENV, resolve_precision, why_exact

DENSE = SimpleNamespace(model_type="llama")
MOE = SimpleNamespace(model_type="qwen3_moe")
README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


@pytest.fixture
def no_exact_env(monkeypatch):
    """The suite runs with RADIXRAY_EXACT=1 (tests/conftest.py); these tests see a user's
    environment."""
    monkeypatch.delenv(EXACT_ENV, raising=False)


def test_where_the_fast_default_applies(no_exact_env):
    cfg = EngineConfig()
    assert why_exact(cfg, DENSE, "avx512_vnni") is None
    for options, hf, kernel, reason in [
        ({"exact": True}, DENSE, "amx", "exact=true"),
        ({"deterministic": True}, DENSE, "amx", "deterministic"),
        ({"dtype": "bfloat16"}, DENSE, "amx", "dtype=bfloat16"),
        ({"tp_size": 2}, DENSE, "amx", "tensor parallelism"),
        ({}, MOE, "amx", "mixture-of-experts"),
        ({}, DENSE, None, "int8 kernels did not load"),
        ({}, DENSE, "avx2", "no fast kernel above 4 rows"),
    ]:
        assert reason in why_exact(EngineConfig(**options), hf, kernel)


def test_exact_env_and_explicit_choices(monkeypatch):
    monkeypatch.setenv(EXACT_ENV, "1")
    config, reason = resolve_precision(EngineConfig(), DENSE)
    assert (config.quantization, config.kv_cache_dtype, reason) == (None, "auto",
                                                                    f"exact: {EXACT_ENV}=1")
    explicit = EngineConfig(quantization="w8a8_int8", kv_cache_dtype="bfloat16")
    assert resolve_precision(explicit, DENSE) == (explicit, "as configured")
    none = EngineConfig(quantization=None)
    assert resolve_precision(none, DENSE)[0].quantization is None
    with pytest.raises(ValueError, match="exact=true runs unquantized"):
        EngineConfig(exact=True, quantization="w8a8_int8")


@pytest.fixture(scope="module")
def int8_kernel():
    from radixray.engine.precision import int8_kernel_kind
    return int8_kernel_kind()


def test_the_default_model_starts_with_its_cpus_default(no_exact_env, int8_kernel, caplog):
    """The fast bundle on VNNI and AMX CPUs, the exact path elsewhere; either way logged."""
    from radixray import Engine
    from radixray.engine.precision import FAST_ON
    with caplog.at_level(logging.INFO, logger="radixray.engine.executor"):
        with Engine(max_total_tokens=1024) as engine:
            facts = engine.model_facts()
            out = engine.generate(prompt="The capital of France is",
                                  sampling_params={"temperature": 0.0, "max_new_tokens": 4})
    assert out["meta_info"]["completion_tokens"] == 4
    if int8_kernel in FAST_ON:
        assert (facts.quantization, facts.kv_cache_dtype) == ("w8a8_int8", "fp8_e5m2")
        assert f"precision: fast CPU default on {int8_kernel}" in caplog.text
        assert "quantization=w8a8_int8" in caplog.text and "lm_head int8" in caplog.text
        assert "compiled decode" in caplog.text and "compiled the decode step" in caplog.text
    else:
        assert (facts.quantization, facts.kv_cache_dtype) == (None, "auto")
        assert "precision: exact: " in caplog.text
        assert "compiled the decode step" not in caplog.text  # eager with exact precision
    with Engine(max_total_tokens=1024, exact=True) as engine:
        facts = engine.model_facts()
    assert (facts.quantization, str(facts.dtype)) == (None, "torch.float32")
    assert facts.precision == "exact: exact=true"


@pytest.mark.slow
def test_the_default_costs_less_than_its_stated_bound(no_exact_env, int8_kernel):
    from radixray.bench.default_quality import check_bounds, measure
    from radixray.engine.precision import FAST_ON
    if int8_kernel not in FAST_ON:
        pytest.skip(f"the default is exact on this CPU ({int8_kernel}); the bundle's prefills "
                    "would run torch._int_mm's slow path here")
    with open(README, encoding="utf-8") as f:
        text = f.read()
    result = measure("default", text, max_tokens=1024, max_new_tokens=32)
    assert len(result["prompts"]) == 32
    assert result["precision_default"].startswith("fast CPU default")
    assert check_bounds(result) == [], result


def test_a_grpo_job_starts_its_own_fleet_exact_but_joins_a_served_one_as_it_is(tiny_llama_dir):
    """The served fleet's name hashes its configuration: the job must look it up with the
    section as written (joining it), and only a fleet it starts itself is made exact."""
    from radixray.rl.config import GRPOConfig
    section = {"engine": {"model": str(tiny_llama_dir)}}
    cfg = GRPOConfig.parse({"model": str(tiny_llama_dir), "fleet": section})
    assert not cfg.serve_config().engine.exact
    own = cfg.own_fleet_config()
    assert own.engine.exact and own.controller_name() != cfg.serve_config().controller_name()
    for chosen in ({"exact": False}, {"quantization": "w8a8_int8"}):
        cfg = GRPOConfig.parse({"model": str(tiny_llama_dir),
                                "fleet": {"engine": {"model": str(tiny_llama_dir), **chosen}}})
        assert cfg.own_fleet_config() is cfg.serve_config()
