"""The fused MoE triton kernel (radixray/kernels/triton_moe.py) against its torch reference
and the engine's LocalExperts.

Runs under triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set below before the
kernel module is imported); with TRITON_INTERPRET=0 on a CUDA machine the same tests run
the compiled kernels on the GPU. Shapes are small: the interpreter runs every program
instance in Python.
"""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from radixray.engine.models.experts import LocalExperts  # noqa: E402
from radixray.kernels.cpu_ops import reference_kernels  # noqa: E402
from radixray.kernels.moe_reference import fused_moe_ref  # noqa: E402
from radixray.kernels.triton_moe import fused_moe, moe_align_block_size  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 and no CUDA device", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"

# Tile sizes that leave partial tiles at H=48, I=40: K=48 and 40 over 32, N=80 and 48 over 32.
TILES = dict(block_m=16, block_n=32, block_k=32)
H, INTER = 48, 40


def _weights(num_experts: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * INTER, H, generator=g) / H ** 0.5
    down = torch.randn(num_experts, H, INTER, generator=g) / INTER ** 0.5
    return gate_up.to(DEVICE, dtype), down.to(DEVICE, dtype)


def _routing(num_tokens: int, num_experts: int, top_k: int, seed: int,
             allowed: list[int] | None = None):
    """Distinct experts per token (as a router picks them) unless ``allowed`` restricts the
    choice, in which case they are drawn with replacement (duplicates must work too)."""
    g = torch.Generator().manual_seed(seed)
    if allowed is None:
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k]
                           for _ in range(num_tokens)]) if num_tokens else \
            torch.empty(0, top_k, dtype=torch.long)
    else:
        pick = torch.randint(len(allowed), (num_tokens, top_k), generator=g)
        ids = torch.tensor(allowed)[pick]
    weights = torch.rand(num_tokens, top_k, generator=g)
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-6)
    return ids.to(DEVICE), weights.to(DEVICE)


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    scale = ref.float().abs().max().item() if ref.numel() else 1.0
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale)


# ---- moe_align_block_size -----------------------------------------------------------------
@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m,allowed", [
    (0, 4, 2, 16, None),
    (1, 4, 1, 16, None),
    (37, 8, 2, 16, None),
    (37, 8, 2, 32, [2, 5]),      # six experts get no pair
    (9, 10, 8, 16, None),
    (64, 4, 2, 16, None),        # every run an exact multiple of block_m: no padding
])
def test_align_block_size_invariants(num_tokens, num_experts, top_k, block_m, allowed):
    ids, _ = _routing(num_tokens, num_experts, top_k, seed=num_tokens + top_k, allowed=allowed)
    sorted_ids, expert_ids, total = moe_align_block_size(ids, num_experts, block_m)
    sorted_ids, expert_ids = sorted_ids.cpu().long(), expert_ids.cpu().long()
    flat = ids.reshape(-1).cpu()
    n = flat.numel()
    total = int(total.item())
    assert sorted_ids.numel() == expert_ids.numel() * block_m
    assert total % block_m == 0 and total <= sorted_ids.numel()

    # Every (token, j) pair exactly once, before `total`; everything else the sentinel n.
    valid = sorted_ids[sorted_ids < n]
    assert torch.equal(valid.sort().values, torch.arange(n))
    assert (sorted_ids[total:] == n).all()
    assert (sorted_ids <= n).all()

    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert total == int(padded.sum())
    used = total // block_m
    assert (expert_ids[used:] == -1).all()
    blocks = sorted_ids[:total].view(used, block_m)
    for i in range(used):
        e = int(expert_ids[i])
        rows = blocks[i][blocks[i] < n]
        assert rows.numel() > 0, "a block with no pair"
        assert (flat[rows] == e).all(), "a block mixes experts"
        # Padding only trails the real rows of a block.
        assert (blocks[i][:rows.numel()] == rows).all()
    # Runs in increasing expert order, each expert's run padded to a multiple of block_m.
    assert (expert_ids[:used].diff() >= 0).all()
    per_expert = torch.bincount(expert_ids[:used], minlength=num_experts) * block_m
    assert torch.equal(per_expert, padded)


# ---- fused_moe against the reference --------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [
    (1, 4, 1),
    (37, 8, 2),      # ragged: 37 * 2 pairs over 16-row blocks
    (9, 10, 8),
])
def test_fused_moe_matches_reference(num_tokens, num_experts, top_k, dtype):
    seed = 7 * num_tokens + top_k
    gate_up, down = _weights(num_experts, dtype, seed)
    hidden = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(seed))
    hidden = hidden.to(DEVICE, dtype)
    ids, weights = _routing(num_tokens, num_experts, top_k, seed)
    out = fused_moe(hidden, gate_up, down, weights, ids, **TILES)
    _check(out, fused_moe_ref(hidden, gate_up, down, weights, ids), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_moe_experts_without_tokens(dtype):
    """E=8 with every pair routed to slots 2 and 5 (duplicates within a token included)."""
    gate_up, down = _weights(8, dtype, seed=3)
    hidden = torch.randn(21, H, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    ids, weights = _routing(21, 8, 2, seed=3, allowed=[2, 5])
    out = fused_moe(hidden, gate_up, down, weights, ids, **TILES)
    _check(out, fused_moe_ref(hidden, gate_up, down, weights, ids), dtype)


def test_fused_moe_default_tiles_and_bf16_router_weights():
    """The GPU default tiles (block_m from the shape, 64 x 32 N x K) mask H=48 and I=40 in
    one partial tile each; top-k weights in bf16 next to fp32 activations."""
    gate_up, down = _weights(4, torch.float32, seed=11)
    hidden = torch.randn(5, H, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    ids, weights = _routing(5, 4, 2, seed=11)
    weights = weights.to(torch.bfloat16)
    out = fused_moe(hidden, gate_up, down, weights, ids)
    _check(out, fused_moe_ref(hidden, gate_up, down, weights, ids), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_moe_no_tokens(dtype):
    gate_up, down = _weights(4, dtype, seed=0)
    hidden = torch.empty(0, H, dtype=dtype, device=DEVICE)
    ids, weights = _routing(0, 4, 2, seed=0)
    out = fused_moe(hidden, gate_up, down, weights, ids)
    assert out.shape == (0, H) and out.dtype == dtype
    ref = fused_moe_ref(hidden, gate_up, down, weights, ids)
    assert ref.shape == (0, H) and ref.dtype == dtype


def test_fused_moe_rejects_mismatched_weight_dtype():
    gate_up, down = _weights(4, torch.float32, seed=0)
    hidden = torch.randn(2, H, device=DEVICE, dtype=torch.bfloat16)
    ids, weights = _routing(2, 4, 1, seed=0)
    with pytest.raises(TypeError, match="must match"):
        fused_moe(hidden, gate_up, down, weights, ids)


# ---- against the engine's LocalExperts -------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_moe_matches_local_experts(dtype):
    """The same weights through ``LocalExperts.dispatch`` with the engine's reference
    kernels (``CpuKernels`` without the C++ extension: ``F.linear`` and torch SiLU)."""
    num_experts, top_k, num_tokens = 6, 2, 19
    experts = LocalExperts(num_experts, H, INTER, reference_kernels())
    gate_up, down = _weights(num_experts, dtype, seed=5)
    with torch.no_grad():
        experts.gate_up_proj.data = gate_up
        experts.down_proj.data = down
    hidden = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(5))
    hidden = hidden.to(DEVICE, dtype)
    ids, weights = _routing(num_tokens, num_experts, top_k, seed=5)
    with torch.no_grad():
        expected = experts.dispatch(hidden, ids, weights)
    out = fused_moe(hidden, experts.gate_up_proj.detach(), experts.down_proj.detach(),
                    weights, ids, **TILES)
    _check(out, expected, dtype)


def test_kernels_package_does_not_import_triton():
    """``radixray.kernels`` and the reference stay importable where triton is not."""
    code = ("import sys, radixray.kernels, radixray.kernels.moe_reference; "
            "assert 'triton' not in sys.modules, 'triton imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
