"""W8A8 int8 linear layers (``quantization="w8a8_int8"``) and their torch reference.

Weights are quantized once at load time, symmetric per output channel
(``w ~= w_q * w_scale[n]``); activations are quantized on every call, symmetric
per token (``x ~= x_q * x_scale[m]``). The product runs as an int8 x int8 ->
int32 GEMM and is rescaled in fp32:

    y[m, n] = acc[m, n] * x_scale[m] * w_scale[n] (+ bias[n])

Per-token scales keep a request's output independent of which other requests
share its batch (a per-tensor activation scale would not). On a 2-vCPU EPYC with
AVX-512 VNNI the int8 GEMM ran 3-5x the fp32 GEMM rate at prefill and batched
decode shapes (docs/benchmarks.md), which is what the mode is for; CPUs without
VNNI gain less. Outputs are close to, not equal to, the fp32 model's.

Which GEMM runs (the integers are the same from all three):

- CPUs with AMX-INT8 (Sapphire Rapids and later): the packed-weight C++ GEMM for
  every row count, on AMX tiles from 12 rows (csrc/int8_amx.h; 1.18x VNNI at 32
  rows and 1.57x at 256 in `radixray bench kernels`; torch._int_mm's oneDNN path
  does not use AMX there) and on VNNI below. ``RADIXRAY_DISABLE_AMX=1`` keeps to the VNNI rules below.
- CPUs with AVX-512 VNNI: up to ``VNNI_M_MAX`` rows a C++ kernel on a copy of the
  weight packed at load time in the instruction's order (csrc/int8_vnni.cpp);
  more rows (prefills) ``torch._int_mm``, where oneDNN is faster. Both
  layouts are kept: twice the int8 weight bytes, still half of bf16's.
- other AVX2 CPUs: up to ``SMALL_M_MAX`` rows the AVX2 kernel
  (``int8_gemm_small_m``), more rows ``torch._int_mm``.
- no C++ kernels: ``torch._int_mm``.
"""

from __future__ import annotations

import torch
from torch import nn

from radixray.kernels import QUANTIZATIONS
from radixray.kernels.cpu_ops import load_extension

_QMAX = 127.0
# Rows up to which the C++ int8 kernel beats torch._int_mm when the weights come from
# memory: 120 model-sized GEMMs took 3.9 / 4.3 / 5.3 / 9.6 ms against 6.3 / 8.2 / 8.8 /
# 9.7 ms at 1 / 2 / 4 / 8 rows on this project's machine (docs/benchmarks.md).
SMALL_M_MAX = 4
# Rows up to which the VNNI kernel on packed weights beats torch._int_mm (120 model-sized
# GEMMs, weights from memory, alternating): 1.27x at 32 rows, 1.00x at 64, 0.86x at 128 and
# 256, 0.79x at 512 (docs/benchmarks.md). An earlier quiet run put 256 rows at 1.1-1.3x;
# four later runs did not.
VNNI_M_MAX = 64


def vnni_available(ext) -> bool:
    """Whether the extension ``ext`` (or None) can run the AVX-512 VNNI GEMM on this CPU."""
    return ext is not None and bool(ext.int8_vnni_supported())


def amx_available(ext) -> bool:
    """Whether the packed GEMM of ``ext`` runs on AMX tiles here: the CPU has AMX-INT8, the
    OS lets the process use it, and ``RADIXRAY_DISABLE_AMX`` is not 1 (read once)."""
    return vnni_available(ext) and bool(ext.int8_amx_supported())


def unpack_vnni(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The [n, k] int8 weight back from ``int8_vnni_pack``'s layout ([blocks, Kp / 4, 16, 4])."""
    blocks = packed.shape[0]
    tiles = packed.view(blocks, -1, 16, 4).permute(0, 2, 1, 3)
    return tiles.reshape(blocks * 16, -1)[:n, :k].contiguous()


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] float -> (int8 [N, K], fp32 scale [N]); symmetric, zero rows get scale 1."""
    w = w.float()
    scale = w.abs().amax(dim=1) / _QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return q, scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] float -> (int8 [M, K], fp32 scale [M]); symmetric per row.

    ``q = round_half_even(x * (1 / scale))``: the C++ kernel does the same fp32
    operations, so both give the same codes.
    """
    x = x.float()
    scale = x.abs().amax(dim=1).clamp_(min=1e-8) / _QMAX
    q = torch.round(x * (1.0 / scale)[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return q, scale


def rescale_ref(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """int32 GEMM result -> fp32: ``(acc * x_scale[m]) * w_scale[n] (+ bias[n])``."""
    y = acc.float().mul_(x_scale[:, None]).mul_(w_scale)
    return y.add_(bias) if bias is not None else y


def int8_linear_ref(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same arithmetic in plain fp64 torch ops: dequantize both sides, then matmul."""
    x_q, x_scale = quantize_per_token(x)
    y = (x_q.double() * x_scale.double()[:, None]) @ (w_q.double() * w_scale.double()[:, None]).t()
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


class Int8Linear(nn.Module):
    """A linear layer whose weight is stored as per-channel int8; ``forward(x)`` for x [M, K]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fused_ops: bool = True):
        super().__init__()
        self.ext = load_extension() if fused_ops else None  # C++ quantize / rescale halves
        w_q, w_scale = quantize_per_channel(weight)
        # _int_mm wants the [K, N] operand; a transposed view of the [N, K] rows is its fast layout.
        self.register_buffer("w_q_t", w_q.t(), persistent=False)
        self.vnni = vnni_available(self.ext)
        self.amx = amx_available(self.ext)
        packed, comp = self.ext.int8_vnni_pack(w_q) if self.vnni else (None, None)
        self.register_buffer("w_vnni", packed, persistent=False)
        self.register_buffer("w_vnni_comp", comp, persistent=False)
        self.register_buffer("w_scale", w_scale, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone(),
                             persistent=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @property
    def w_q(self) -> torch.Tensor:
        return self.w_q_t.t()

    def _vnni_for(self, rows: int) -> bool:
        return self.vnni and (rows <= VNNI_M_MAX or self.amx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ext = self.ext
        if ext is not None and x.dtype == torch.float32:
            if self._vnni_for(x.shape[0]):  # quantize, GEMM and rescale in one call, same bits
                return ext.int8_vnni_linear(x, None, self.w_vnni, self.w_vnni_comp, self.w_scale, self.bias,
                                            self.out_features)
            return self.from_codes(*ext.quantize_rows_int8(x))
        x_q, x_scale = quantize_per_token(x)
        return rescale_ref(self.accumulate(x_q), x_scale, self.w_scale, self.bias).to(x.dtype)

    def from_codes(self, x_q: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """fp32 output from activations already quantized (codes [M, K], scales [M]); C++ kernels only."""
        if self._vnni_for(x_q.shape[0]):  # GEMM and rescale in one call
            return self.ext.int8_vnni_linear(x_q, x_scale, self.w_vnni, self.w_vnni_comp, self.w_scale,
                                             self.bias, self.out_features)
        return self.ext.rescale_int8_acc(self.accumulate(x_q), x_scale, self.w_scale, self.bias)

    def accumulate(self, x_q: torch.Tensor) -> torch.Tensor:
        """The int32 GEMM alone: ``x_q`` [M, K] int8 codes -> [M, N] int32 accumulator,
        by the kernel the module docstring names for this CPU and M; the integers are
        the same whichever runs."""
        rows = x_q.shape[0]
        if self._vnni_for(rows):
            return self.ext.int8_vnni_gemm(x_q, self.w_vnni, self.w_vnni_comp, self.out_features)
        if self.ext is not None and rows <= SMALL_M_MAX:
            return self.ext.int8_gemm_small_m(x_q, self.w_q)
        return torch._int_mm(x_q, self.w_q_t)

    def fused_gated_mlp(self, x: torch.Tensor, down: nn.Module) -> torch.Tensor | None:
        """This layer as the gate|up projection of a gated MLP ending in ``down``, run by
        :func:`int8_gated_mlp`; None when that does not apply (``down`` not int8, no C++
        kernels, input not fp32)."""
        if (not isinstance(down, Int8Linear) or self.ext is None or down.ext is None
                or x.dtype != torch.float32 or x.is_cuda):
            return None
        return int8_gated_mlp(x, self, down)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8_int8"


def int8_gated_mlp(x: torch.Tensor, gate_up: Int8Linear, down: Int8Linear) -> torch.Tensor:
    """``down(silu(gate) * up)`` for ``gate_up(x) = [gate | up]``, both layers int8.

    Between the two GEMMs one C++ pass per row rescales the gate|up accumulator,
    applies silu-mul and quantizes the result for ``down``, so the [M, 2I] fp32
    activation is never written out; with packed weights on AMX and a few blocks of
    32 rows per thread, that pass runs in the GEMM's epilogue and the int32
    accumulator is not written out either (csrc/int8_gated_amx.h). The codes equal
    those of ``gate_up(x)``, ``silu_mul``, then ``down``'s own quantization
    (tests/cpu/test_int8_linear.py).
    """
    ext = gate_up.ext
    if gate_up._vnni_for(x.shape[0]):  # all of it in one call (on AMX tiles: the accumulator stays in them)
        h_q, h_scale = ext.int8_vnni_gated_codes(x, gate_up.w_vnni, gate_up.w_vnni_comp, gate_up.w_scale,
                                                 gate_up.bias, gate_up.out_features)
    else:
        x_q, x_scale = ext.quantize_rows_int8(x)
        h_q, h_scale = ext.rescale_silu_mul_quantize(gate_up.accumulate(x_q), x_scale, gate_up.w_scale,
                                                     gate_up.bias)
    return down.from_codes(h_q, h_scale)


class Int8ReferenceLinear(nn.Module):
    """The reference arithmetic (:func:`int8_linear_ref`) as a drop-in for an ``nn.Linear`` of
    any model, inputs of any leading shape: lets a Hugging Face model run the same
    quantization as the engine, for tests and quality measurements."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.w_q, self.w_scale = quantize_per_channel(linear.weight.data)
        self.bias = None if linear.bias is None else linear.bias.data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        return int8_linear_ref(flat, self.w_q, self.w_scale, self.bias).reshape(*x.shape[:-1], -1)


def replace_linears(model: nn.Module, make, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace each ``nn.Linear`` of ``model`` not named in ``skip`` by ``make(linear)``; return the count."""
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] not in skip]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(mod))
    return len(targets)


def quantize_linears(model: nn.Module, method: str | None, skip: tuple[str, ...] = ("lm_head",),
                     fused_ops: bool = True) -> int:
    """Replace every ``nn.Linear`` of ``model`` (but those named in ``skip``) by its quantized form.

    Returns how many layers were replaced. ``method=None`` leaves the model as it is.
    The fp32 weights of replaced layers are released. ``fused_ops=False`` keeps the
    quantize / rescale steps in torch ops (the GEMM is ``torch._int_mm`` either way).
    """
    if method is None:
        return 0
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    return replace_linears(model, lambda mod: Int8Linear(
        mod.weight.data, mod.bias.data if mod.bias is not None else None, fused_ops=fused_ops), skip)
