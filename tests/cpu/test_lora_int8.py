"""LoRA in an int8 engine: the long runs' shrinks run as int8 GEMMs on the codes the base
projection quantized (kernels/lora.py ``Int8Shrink``), against A's codes that LoraSlots keeps
beside A and refills with every slot fill (a load or an in-place update).

The int8 update equals the reference computed on the dequantized operands; rows grouped by
slot (short runs) keep the fp32 shrink, rows without an adapter are untouched; an int8
engine's prefill of a long prompt takes the int8 shrinks, an fp32 engine never does; the
tokens stay close to the fp32 engine's (test_lora.py's int8 test).
"""

from __future__ import annotations

import pytest
import torch

from radixray import Engine
from radixray.engine.weights.lora_slots import LoraSlots
from radixray.engine.weights.peft_adapter import read_peft_adapter
from radixray.kernels.int8_linear import quantize_per_channel, quantize_per_token
from radixray.kernels.lora import (
    MIN_INT8_ROWS,
    MIN_PART_ROWS,
    MIN_RUN_ROWS,
    Int8Shrink,
    LoraRows,
    lora_add,
    lora_add_reference,
)


def _int8_operands(x: torch.Tensor, a: torch.Tensor) -> tuple[Int8Shrink, torch.Tensor, torch.Tensor]:
    """The Int8Shrink of ``x`` ``[T, in]`` and ``a`` ``[slots, width, in]``, and the two
    dequantized operands (what the int8 GEMM computes on, exactly)."""
    x_q, x_scale = quantize_per_token(x)
    pairs = [quantize_per_channel(w) for w in a]
    a_q = torch.stack([q for q, _ in pairs])
    a_scale = torch.stack([s for _, s in pairs])
    x_deq = x_q.double() * x_scale.double()[:, None]
    a_deq = a_q.double() * a_scale.double()[..., None]
    return Int8Shrink(x_q, x_scale, a_q, a_scale), x_deq, a_deq


def test_int8_shrinks_equal_the_reference_on_the_dequantized_operands():
    """Runs long and short on a fused target (q|k|v by parts past MIN_PART_ROWS rows), riders
    grouped by slot: the runs of MIN_INT8_ROWS rows and more equal the reference on the
    dequantized x and A, a shorter run and the grouped rows the fp32 reference, rows of no
    adapter are untouched."""
    gen = torch.Generator().manual_seed(5)
    rank, parts = 4, (24, 8, 8)
    row_slots = torch.tensor([2, -1, 0] + [1] * MIN_PART_ROWS + [2] * MIN_RUN_ROWS + [0, -1])
    x, a = (torch.randn(shape, generator=gen) for shape in ((len(row_slots), 48), (3, 12, 48)))
    b = torch.zeros(3, sum(parts), len(parts) * rank)  # q|k|v's block-diagonal B per slot
    for i, (start, width) in enumerate(zip((0, 24, 32), parts)):
        b[:, start:start + width, i * rank:(i + 1) * rank] = torch.randn(3, width, rank,
                                                                         generator=gen)
    scalings = torch.tensor([0.5, 2.0, 1.25])
    base = torch.randn(len(row_slots), sum(parts), generator=gen)
    plan = LoraRows.of(row_slots)
    int8, x_deq, a_deq = _int8_operands(x, a)
    got = lora_add(base.clone(), x, a, b, scalings, plan, parts, int8)

    in_runs = torch.zeros(len(row_slots), dtype=torch.bool)
    for _, start, end in plan.runs:
        in_runs[start:end] = end - start >= MIN_INT8_ROWS
    assert MIN_RUN_ROWS < MIN_INT8_ROWS <= MIN_PART_ROWS and in_runs.sum() == MIN_PART_ROWS
    on_codes = lora_add_reference(base.double(), x_deq, a_deq, b.double(), scalings, row_slots)
    torch.testing.assert_close(got[in_runs], on_codes[in_runs].float(), rtol=1e-5, atol=1e-5)
    fp32 = lora_add_reference(base, x, a, b, scalings, row_slots)
    grouped = ~in_runs & (row_slots >= 0)  # the short run of slot 2 and the riders
    torch.testing.assert_close(got[grouped], fp32[grouped], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[row_slots < 0], base[row_slots < 0])
    # the int8 update is the fp32 one to the quantization's rounding, not another update
    delta, delta_fp32 = (got - base)[in_runs], (fp32 - base)[in_runs]
    assert (delta - delta_fp32).norm() < 0.05 * delta_fp32.norm()


@pytest.fixture(scope="module")
def int8_lora_eng(tiny_llama_dir, lora_adapters):
    paths = [f"{name}={path}" for name, path in lora_adapters.items()]
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=2048, exact=False,
                quantization="w8a8_int8", lora_paths=paths,
                check_kv_conservation=True) as engine:
        yield engine
        engine.check_kv_conservation()


def test_an_int8_engine_prefills_long_runs_on_codes(int8_lora_eng, lora_adapters, monkeypatch):
    """A prompt of MIN_INT8_ROWS tokens and more with an adapter: its prefill's shrinks take
    the int8 GEMM, one per LoRA target and layer (its decode steps, single rows, do not);
    A's codes in the slots are A's own."""
    slots = int8_lora_eng.runner.lora
    assert slots.int8_shrink
    calls = []
    shrink = Int8Shrink.shrink
    monkeypatch.setattr(Int8Shrink, "shrink", lambda self, *span: calls.append(span) or shrink(self, *span))
    prompt = list(range(5, 5 + MIN_INT8_ROWS + 8))
    params = {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True}
    out = int8_lora_eng.generate(input_ids=[prompt], sampling_params=params, lora_path=["alpha"])
    assert len(out[0]["output_ids"]) == 3
    layers = slots.num_layers
    assert len(calls) == len(slots.targets) * layers, calls[:4]
    slot = slots.slot_names.index("alpha")
    for name in slots.targets:
        for layer in range(layers):
            codes, scales = quantize_per_channel(slots.a[name][layer, slot])
            a_q, a_scale = slots.int8_weights(name, layer)
            assert torch.equal(a_q[slot], codes)
            torch.testing.assert_close(a_scale[slot], scales, rtol=0, atol=0)


def test_a_slot_refill_requantizes_and_fp32_engines_keep_no_codes(int8_lora_eng, lora_eng_fp32,
                                                                   lora_adapters):
    """A slot filled again with new weights (an adapter updated in place) gets their codes;
    an fp32 engine keeps no codes and never takes the int8 shrink."""
    model = int8_lora_eng.runner.model
    slots = LoraSlots(model, 2, 8, torch.float32, "cpu")
    assert slots.int8_shrink
    adapter = read_peft_adapter("alpha", lora_adapters["alpha"], slots.num_layers)
    slots.register(adapter)
    slot = slots.prepare({"alpha"})["alpha"]
    before = slots.a_q["qkv"][:, slot].clone()
    doubled = read_peft_adapter("alpha", lora_adapters["alpha"], slots.num_layers)
    for key, (la, lb) in doubled.weights.items():
        doubled.weights[key] = (la * -3.0, lb)
    slots.replace(doubled, "v2", [])
    codes, _ = quantize_per_channel(slots.a["qkv"][0, slot])
    assert torch.equal(slots.a_q["qkv"][0, slot], codes)
    assert not torch.equal(slots.a_q["qkv"][:, slot], before)
    fp32_slots = lora_eng_fp32.runner.lora
    assert not fp32_slots.int8_shrink and fp32_slots.a_q == {}


@pytest.fixture(scope="module")
def lora_eng_fp32(tiny_llama_dir, lora_adapters):
    paths = [f"{name}={path}" for name, path in lora_adapters.items()]
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=2048,
                lora_paths=paths) as engine:
        yield engine

