"""Compiled decode graphs check the model's guards once per control call, the batch's on
every step (engine/executor/guard_split.py), and never run a graph that does not fit.

A toy function shows the mechanism and its safety net: a batch no graph fits goes through
dynamo; a model change is seen only through a new epoch, and without one the test-mode
check (RADIXRAY_COMPILE_CHECK_GUARDS, on in every test) refuses the stale graph. The engine
test runs a compiled engine beside an eager one through a weight update, its rollback and a
memory release and resume: the same tokens after each, the steps between them direct.
"""

from __future__ import annotations

import types

import pytest
import torch
from model_fixtures import random_prompts
from weight_helpers import GREEDY_N, perturb

from radixray import Engine
from radixray.engine.executor.guard_split import SplitGuards


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.ones(4))
        self.scale = 2


def _scaled(model, batch):
    return model.w * batch.x * model.scale


def _split() -> SplitGuards:
    fn = types.FunctionType(_scaled.__code__.replace(), _scaled.__globals__, "_scaled")
    return SplitGuards(torch.compile(fn, fullgraph=True, backend="eager"), fn)


def test_the_model_guards_wait_for_a_new_epoch_and_the_batch_guards_do_not(monkeypatch):
    split, model = _split(), _Model()
    x = types.SimpleNamespace(x=torch.arange(4.0))
    assert torch.equal(split(model, x), x.x * 2)
    assert torch.equal(split(model, x), x.x * 2)
    assert (split.dynamo_calls, split.direct_calls, len(split.entries)) == (1, 1, 1)
    # a batch the graph does not fit (another dtype) goes through dynamo: a second graph
    x64 = types.SimpleNamespace(x=torch.arange(4.0, dtype=torch.float64))
    assert split(model, x64).dtype == torch.float64
    assert (split.dynamo_calls, len(split.entries)) == (2, 2)
    split(model, x64)
    split(model, x)
    assert split.direct_calls == 3

    model.scale = 3  # behind the scheduler's back: the test-mode check refuses the graph
    with pytest.raises(AssertionError, match="without a new model epoch"):
        split(model, x)
    monkeypatch.delenv("RADIXRAY_COMPILE_CHECK_GUARDS")
    assert torch.equal(split(model, x), x.x * 2)  # what the check exists for: a stale graph
    split.model_changed()  # what the scheduler does after every control call
    assert torch.equal(split(model, x), x.x * 3)
    assert split.dynamo_calls == 3
    assert torch.equal(split(model, x), x.x * 3)
    assert split.direct_calls == 5


def _compiled_calls(engine) -> tuple[int, int]:
    forwards = engine.runner.compiled_decode._forwards.values()
    return sum(f.direct_calls for f in forwards), sum(f.dynamo_calls for f in forwards)


@pytest.mark.parametrize("quant", [None, pytest.param("w8a8_int8", marks=pytest.mark.slow)])
def test_compiled_steps_follow_weight_updates_rollbacks_and_memory_release(tiny_llama_dir,
                                                                           quant):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    named = perturb(hf, seed=3)
    options = {"model": tiny_llama_dir, "dtype": "float32", "max_total_tokens": 4096,
               "quantization": quant, "quantize_lm_head": quant is not None,
               "check_kv_conservation": True}
    with Engine(**options) as eager, Engine(enable_torch_compile=True, **options) as compiled:
        prompts = random_prompts(eager.limits.vocab_size)[:4]
        params = {**GREEDY_N, "max_new_tokens": 12}

        def same_tokens(label: str) -> list:
            want = [o["output_ids"] for o in eager.generate(input_ids=prompts,
                                                            sampling_params=params)]
            direct = _compiled_calls(compiled)[0]
            got = [o["output_ids"] for o in compiled.generate(input_ids=prompts,
                                                              sampling_params=params)]
            assert got == want, label
            assert _compiled_calls(compiled)[0] > direct, f"{label}: no step ran direct"
            return got

        first = same_tokens("loaded weights")
        for engine in (eager, compiled):
            engine.begin_weight_update()
            engine.update_weights_from_tensor(list(named.items()))
            engine.end_weight_update(1)
        assert same_tokens("updated weights") != first
        for engine in (eager, compiled):
            engine.begin_weight_update()
            engine.update_weights_from_tensor(list(perturb(hf, seed=4).items()))
            engine.prepare_weight_update(2)
            engine.commit_weight_update()
            assert engine.rollback_weight_update() is True
        same_tokens("rolled back to version 1")
        for engine in (eager, compiled):
            engine.pause_generation("retract")
            engine.release_memory_occupation()
            engine.resume_memory_occupation()
            assert engine.continue_generation() is True
        same_tokens("memory released and resumed")
        compiled.check_kv_conservation()
