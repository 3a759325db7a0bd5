"""The batched LoRA matmul in triton (radixray/kernels/triton_lora.py) against its row-by-row
reference and the torch version the engine runs on the CPU.

Runs under triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set below before the
kernel module is imported); with TRITON_INTERPRET=0 on a CUDA machine the same tests run
the compiled kernels on the GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from radixray.kernels.lora import LoraRows, lora_add, lora_add_reference  # noqa: E402
from radixray.kernels.triton_lora import lora_add_triton, lora_segments  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 and no CUDA device", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"


def _case(dtype: torch.dtype, seed: int, rank: int = 12, d_in: int = 72, d_out: int = 40):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(3, rank, d_in, generator=g) / d_in ** 0.5
    b = torch.randn(3, d_out, rank, generator=g)
    x = torch.randn(37, d_in, generator=g)
    base = torch.randn(37, d_out, generator=g)
    # requests of 5, 1, 17, 3, 9 and 2 rows: two without an adapter, one longer than a block
    lens, slots = [5, 1, 17, 3, 9, 2], [0, -1, 2, 2, -1, 1]
    row_slots = torch.cat([torch.full((n,), s) for n, s in zip(lens, slots)])
    return [t.to(DEVICE, dtype) for t in (a, b, x, base)], row_slots.to(DEVICE)


def test_segments_are_runs_of_one_slot():
    indptr, slots, longest = lora_segments(torch.tensor([0, 0, -1, 2, 2, 2, 0]))
    assert indptr.tolist() == [0, 2, 3, 6, 7] and slots.tolist() == [0, -1, 2, 0]
    assert longest == 3


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_triton_lora_matmul_equals_the_reference(dtype, tol):
    (a, b, x, base), row_slots = _case(dtype, 0)
    scalings = torch.tensor([0.5, 2.0, 1.25], device=DEVICE)
    want = lora_add_reference(base.cpu(), x.cpu(), a.cpu(), b.cpu(), scalings.cpu(),
                              row_slots.cpu())
    got = lora_add_triton(base.clone(), x, a, b, scalings, lora_segments(row_slots))
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=tol, atol=tol)
    untouched = row_slots < 0
    assert torch.equal(got[untouched], base[untouched])
    if dtype == torch.float32:  # and the torch version the engine runs on the CPU
        torch_rows = lora_add(base.clone(), x, a, b, scalings.cpu(), LoraRows.of(row_slots))
        torch.testing.assert_close(got, torch_rows, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not INTERPRET, reason="the engine here runs on the CPU")
def test_the_engine_gives_the_same_tokens_through_the_triton_kernels(tiny_llama_dir,
                                                                     lora_adapters):
    from radixray import Engine
    greedy = {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True}
    prompts = [[5, 9, 13, 2, 44], [7, 7, 8], [100, 3, 19, 27]]
    loras = ["alpha", None, "beta"]
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=1024,
                lora_paths=[f"{n}={p}" for n, p in lora_adapters.items()],
                disable_radix_cache=True) as eng:
        by_torch = eng.generate(input_ids=prompts, sampling_params=greedy, lora_path=loras)
        eng.call_in_loop(lambda s: setattr(s.runner.lora, "kernel", "triton"))
        by_triton = eng.generate(input_ids=prompts, sampling_params=greedy, lora_path=loras)
    assert [o["output_ids"] for o in by_triton] == [o["output_ids"] for o in by_torch]
