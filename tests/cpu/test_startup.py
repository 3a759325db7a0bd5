"""The start-up log states the computed limits, and the pool is sized from memory or explicitly."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from radixray import Engine
from radixray.engine.mem_cache.pool import kv_bytes_per_token


def _limits_line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if "max_total_num_tokens=" in r.getMessage()]
    assert lines, "no start-up line with the computed limits"
    return lines[-1]


@pytest.mark.parametrize("dtype,nbytes", [("float32", 4), ("bfloat16", 2)])
def test_startup_log_states_limits(tiny_llama_dir, caplog, dtype, nbytes):
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(tiny_llama_dir)
    caplog.set_level(logging.INFO)
    with Engine(model=tiny_llama_dir, dtype=dtype, max_total_tokens=1000,
                chunked_prefill_size=64, max_running_requests=7) as eng:
        line = _limits_line(caplog)
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        expected = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * nbytes
        assert expected == kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                              head_dim, getattr(torch, dtype))
        assert f"bytes_per_token={expected}," in line
        assert "max_total_num_tokens=1000," in line
        assert "chunked_prefill_size=64," in line
        assert "max_running_requests=7," in line
        assert f"context_len={cfg.max_position_embeddings}," in line
        assert f"dtype={dtype}," in line
        assert ("attention_backend=cpu_paged" if dtype == "float32" else "attention_backend=torch") in line
        assert eng.runner.kv_pool.k_buffers[0].shape == (1001, cfg.num_key_value_heads, head_dim)


def test_pool_sized_from_memory_fraction(tiny_llama_dir, caplog):
    caplog.set_level(logging.INFO)
    with Engine(model=tiny_llama_dir, mem_fraction_static=0.02) as eng:
        line = _limits_line(caplog)
        size = int(re.search(r"max_total_num_tokens=(\d+)", line).group(1))
        assert size == eng.runner.max_total_tokens > 1000
        out = eng.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3,
                                                                 "ignore_eos": True})
        assert out["meta_info"]["completion_tokens"] == 3
    assert re.search(r"dtype=float32 \(auto", caplog.text)


def test_bad_engine_options_name_the_field(tiny_llama_dir):
    with pytest.raises(ValueError, match="mem_fraction_static"):
        Engine(model=tiny_llama_dir, mem_fraction_static=1.5)
    with pytest.raises(ValueError, match="schedule_policy"):
        Engine(model=tiny_llama_dir, schedule_policy="random")
    with pytest.raises(TypeError, match="unknown engine option"):
        Engine(model=tiny_llama_dir, max_tokens_total=5)
