"""Fused fp32 CPU kernels (C++ in csrc/cpu_ops.cpp) and their pure-torch references.

The same extension carries the quantize / rescale halves of the int8 linear
(csrc/int8_ops.cpp, used by ``int8_linear.Int8Linear``).

The extension is compiled on first use with torch's cpp_extension, cached under
~/.cache/radixray/torch_extensions in one folder per source contents, torch and Python
version and flags: about a minute once per machine, whatever the checkout or venv.
Where it cannot be built (no compiler, no AVX2) or an input is not fp32 on the CPU,
every op falls back to its reference, and the choice is logged once.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
import threading
import time

import torch
import torch.nn.functional as F

from radixray.kernels.fake_ops import register_fake_ops

logger = logging.getLogger(__name__)

SMALL_M_MAX = 64  # up to this many rows the C++ linear beats the BLAS path here (docs/benchmarks.md)

_ext = None
_tried = False
_lock = threading.Lock()


def load_extension():
    """The compiled module, or None if it cannot be built on this machine."""
    global _ext, _tried
    with _lock:
        if _tried:
            return _ext
        _tried = True
        if os.environ.get("RADIXRAY_DISABLE_CPU_KERNELS") == "1":
            logger.info("CPU kernels disabled by RADIXRAY_DISABLE_CPU_KERNELS=1; using torch ops")
            return None
        if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512", "AVX512_BF16"):
            logger.info("CPU kernels need AVX2; using torch ops")
            return None
        try:
            csrc = os.path.join(os.path.dirname(__file__), "csrc")
            build_dir = _build_directory(csrc, CFLAGS)
            built = os.path.exists(os.path.join(build_dir, BUILT_MARKER))
            logger.info("%s radixray CPU kernels (%s)", "Loading" if built else "Compiling",
                        build_dir if built else "once per machine and source version, ~1 min")
            t0 = time.perf_counter()
            with _build_lock(build_dir):  # a process that built meanwhile wrote the marker
                if not os.path.exists(os.path.join(build_dir, BUILT_MARKER)):
                    _compile(csrc, build_dir)
                torch.ops.load_library(os.path.join(build_dir, LIBRARY))
            _ext = torch.ops.radixray
            register_fake_ops()  # torch.compile traces through the ops (fake_ops.py)
            logger.info("radixray CPU kernels ready in %.1f s", time.perf_counter() - t0)
        except Exception as exc:  # no compiler / headers: stay correct, just slower
            logger.warning("radixray CPU kernels unavailable (%s); using torch ops", exc)
            _ext = None
        return _ext


CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
SOURCES = ("cpu_ops.cpp", "attention.cpp", "attention_amx.cpp", "decode_avx512.cpp",
           "int8_ops.cpp", "int8_vnni.cpp", "kv_store.cpp")
LIBRARY = "radixray_cpu_ops.so"
BUILT_MARKER = "radixray.built"  # written after a build succeeded: later loads only dlopen


def _compile(csrc: str, build_dir: str) -> None:
    """Build the library in ``build_dir`` from a copy of ``csrc`` kept there: torch's ninja
    rebuilds whenever a source path or the command line changes, so a build made from
    this checkout's paths would be redone by every other checkout and venv. The copy
    and the marker make the folder (keyed by the sources' contents) the only input."""
    import shutil

    from torch.utils.cpp_extension import load
    src = os.path.join(build_dir, "src")
    os.makedirs(src, exist_ok=True)
    for name in os.listdir(csrc):
        shutil.copy2(os.path.join(csrc, name), os.path.join(src, name))
    with _compile_ticker(build_dir, len(SOURCES)):
        load(name="radixray_cpu_ops", sources=[os.path.join(src, n) for n in SOURCES],
             build_directory=build_dir, extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
             verbose=False)
    with open(os.path.join(build_dir, BUILT_MARKER), "w") as f:
        f.write(torch.__version__ + "\n")


def _build_directory(csrc: str, cflags: list[str] = CFLAGS) -> str:
    """One build folder per version of the kernel sources (their contents), torch and
    Python version and flags: checkouts with the same sources on one machine share one build (a fresh
    clone does not compile again), and a checkout with edited sources never rebuilds over
    another's."""
    digest = hashlib.sha1(f"{torch.__version__}|{sys.version_info[:2]}|{' '.join(cflags)}"
                          .encode())
    for name in sorted(os.listdir(csrc)):
        with open(os.path.join(csrc, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    key = digest.hexdigest()[:12]
    root = os.environ.get("RADIXRAY_CACHE_DIR", os.path.expanduser("~/.cache/radixray"))
    path = os.path.join(root, "torch_extensions", f"radixray_cpu_ops-{key}")
    os.makedirs(path, exist_ok=True)
    return path


def _compile_ticker(build_dir: str, sources: int):
    """While a compile runs, a line every 10 s: sources compiled so far (their object
    files in ``build_dir``) and the time spent."""
    from radixray.common.progress import Ticker

    def message(elapsed: float) -> str:
        done = sum(name.endswith(".o") for name in os.listdir(build_dir))
        return f"compiling radixray CPU kernels: {done}/{sources} sources done ({elapsed:.0f} s)"
    return Ticker(message, logger, 10.0)


class _build_lock:
    """An exclusive ``flock`` on the build folder while torch builds or loads there. The
    kernel drops it when its holder dies, so unlike torch's own lock file (left behind
    by a process killed mid-build, after which every later load waits forever) it cannot
    go stale; holding it, a leftover torch lock file is known to be stale and removed."""

    def __init__(self, build_dir: str):
        self.build_dir = build_dir

    def __enter__(self):
        self.file = open(os.path.join(self.build_dir, "radixray.flock"), "w")
        fcntl.flock(self.file, fcntl.LOCK_EX)
        stale = os.path.join(self.build_dir, "lock")
        if os.path.exists(stale):
            logger.warning("removing a stale build lock left by a killed process: %s", stale)
            os.remove(stale)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


# ---- references -------------------------------------------------------------------------
def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    a, b = gate_up.chunk(2, dim=-1)
    return F.silu(a) * b


def rotary_ref(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of ``x`` [T, heads, D] with [P, D] cos/sin tables."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * c + rotated * s


def paged_decode_attention_ref(q, k_pool, v_pool, kv_indices, seq_lens, scale):
    """q [B,H,D]; pools [S,KVH,D] (any dtype, widened to q's); kv_indices [B,Lmax]; seq_lens [B] -> [B,H,D]."""
    out = []
    for b in range(q.shape[0]):
        idx = kv_indices[b, : int(seq_lens[b])]
        k = k_pool[idx].transpose(0, 1).to(q.dtype)
        v = v_pool[idx].transpose(0, 1).to(q.dtype)
        out.append(F.scaled_dot_product_attention(q[b][:, None], k, v, scale=scale,
                                                  enable_gqa=True)[:, 0])
    return torch.stack(out)


def extend_attention_bf16_ref(q, k, v, plen: int, scale: float):
    """What ``extend_attention_bf16`` computes: q [n, H, D] scaled then rounded to bf16, k/v
    [plen + n, KVH, D] (bf16-exact), scores in fp32, exp(score - row max) rounded to bf16,
    sums in fp32, each row divided by its fp32 sum of exps at the end; token i sees keys
    0 .. plen + i -> [n, H, D] fp32."""
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    qb = (q.float() * scale).bfloat16().float()
    kx = k.float().repeat_interleave(group, dim=1)
    vx = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,thd->hnt", qb, kx)
    future = torch.ones(n, plen + n, dtype=torch.bool).tril(diagonal=plen).logical_not()
    scores = scores.masked_fill(future, float("-inf"))
    exps = (scores - scores.amax(-1, keepdim=True)).exp()
    out = torch.einsum("hnt,thd->nhd", exps.bfloat16().float(), vx)
    return out / exps.sum(-1).transpose(0, 1)[..., None]


# ---- dispatch ---------------------------------------------------------------------------
class CpuKernels:
    """The fused ops the model calls; each runs the C++ kernel when it applies, else torch."""

    def __init__(self, enabled: bool):
        self.ext = load_extension() if enabled else None

    @property
    def active(self) -> bool:
        return self.ext is not None

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.ext is not None and x.shape[0] <= SMALL_M_MAX and x.dtype == torch.float32 \
                and not x.is_cuda:
            y = self.ext.linear_small_m(x, w)
            return y + bias if bias is not None else y
        return F.linear(x, w, bias)

    def project(self, x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
        """Apply a projection layer: an ``nn.Linear`` through :meth:`linear`, any other
        layer (a quantized one, see ``int8_linear.Int8Linear``) through its own forward."""
        if isinstance(layer, torch.nn.Linear):
            return self.linear(x, layer.weight, layer.bias)
        return layer(x)

    def gated_mlp(self, x: torch.Tensor, gate_up: torch.nn.Module, down: torch.nn.Module) -> torch.Tensor:
        """``down(silu(gate) * up)`` where ``gate_up(x) = [gate | up]``. A layer type with a fused
        form (``Int8Linear.fused_gated_mlp``) runs it; it returns None where it does not apply."""
        fused = getattr(gate_up, "fused_gated_mlp", None)
        y = fused(x, down) if fused is not None else None
        if y is not None:
            return y
        return self.project(self.silu_mul(self.project(x, gate_up)), down)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if self.ext is not None and x.dtype == torch.float32 and not x.is_cuda:
            return self.ext.rms_norm(x, w, eps)
        return rms_norm_ref(x, w, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, rms_norm(h))`` for ``h = residual + x``: the residual stream's add and the next
        norm in one pass (the same values as the two separate ops)."""
        if self.ext is not None and x.dtype == torch.float32 and not x.is_cuda:
            h, y = self.ext.add_rms_norm(x, residual, w, eps)
            return h, y
        h = residual + x
        return h, self.rms_norm(h, w, eps)

    def rotary(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        if self.ext is not None and x.dtype == torch.float32 and not x.is_cuda \
                and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
            return self.ext.rotary(x, positions, cos, sin)
        return rotary_ref(x, positions, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.ext is not None and gate_up.dtype == torch.float32 and not gate_up.is_cuda:
            return self.ext.silu_mul(gate_up)
        return silu_mul_ref(gate_up)


class BatchInvariantKernels(CpuKernels):
    """The kernels of deterministic mode: every output row is computed by the same
    arithmetic whatever the other rows, the row count and the thread count.

    The C++ linear computes each output element as one 8-lane FMA chain over K in order
    and one horizontal sum, for any M (the BLAS path above ``SMALL_M_MAX`` rows picks its
    blocking from the shape, so it is not used here); the norms, rotary and SiLU kernels
    work row by row. Needs the extension: RuntimeError when it did not load.
    """

    def __init__(self):
        super().__init__(enabled=True)
        if self.ext is None:
            raise RuntimeError("deterministic mode needs the radixray CPU kernels (an AVX2 CPU and "
                               "a C++ compiler) and they did not load (see the log above); run "
                               "with deterministic off")

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.float32 or x.is_cuda or w.dtype != torch.float32:
            raise TypeError(f"deterministic mode computes in float32 on the CPU, got {x.dtype} "
                            f"on {x.device}")
        y = self.ext.linear_small_m(x, w)
        return y + bias if bias is not None else y


_REFERENCE = CpuKernels(enabled=False)


def reference_kernels() -> CpuKernels:
    return _REFERENCE
