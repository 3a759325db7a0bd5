"""Every fused CPU kernel against its pure-torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixray.kernels import cpu_ops

ext = cpu_ops.load_extension()
pytestmark = pytest.mark.skipif(ext is None, reason="radixray CPU kernels could not be built here")


@pytest.mark.parametrize("m", [1, 2, 3, 8, 33, 64])
@pytest.mark.parametrize("n,k", [(1536, 576), (7, 64), (10, 20)])
def test_linear_small_m(m, n, k):
    torch.manual_seed(m * n + k)
    x, w = torch.randn(m, k), torch.randn(n, k)
    torch.testing.assert_close(ext.linear_small_m(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_linear_dispatch_uses_blas_for_large_m_and_adds_bias():
    kernels = cpu_ops.CpuKernels(enabled=True)
    x, w, b = torch.randn(100, 32), torch.randn(24, 32), torch.randn(24)
    torch.testing.assert_close(kernels.linear(x, w, b), F.linear(x, w, b))
    torch.testing.assert_close(kernels.linear(x[:3], w, b), F.linear(x[:3], w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (130, 96), (3, 4, 32)])
def test_rms_norm(shape):
    x, w = torch.randn(shape) * 3, torch.randn(shape[-1])
    torch.testing.assert_close(ext.rms_norm(x, w, 1e-5), cpu_ops.rms_norm_ref(x, w, 1e-5),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (130, 96), (3, 4, 32)])
def test_add_rms_norm_equals_the_add_then_the_norm(shape):
    x, res, w = torch.randn(shape) * 3, torch.randn(shape) * 5, torch.randn(shape[-1])
    h, y = ext.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(h, res + x)  # the residual stream keeps torch's exact sums
    assert torch.equal(y, ext.rms_norm(res + x, w, 1e-5))
    torch.testing.assert_close(y, cpu_ops.rms_norm_ref(res + x, w, 1e-5), rtol=1e-5, atol=1e-5)
    kernels = cpu_ops.CpuKernels(enabled=False)  # the torch fallback gives the same pair
    h_ref, y_ref = kernels.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(h_ref, h)
    torch.testing.assert_close(y_ref, y, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="shapes differ"):
        ext.add_rms_norm(x, res[..., :-1], w, 1e-5)


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_silu_mul(rows):
    g = torch.randn(rows, 2 * 160) * 4
    torch.testing.assert_close(ext.silu_mul(g), cpu_ops.silu_mul_ref(g), rtol=1e-5, atol=1e-6)


def test_silu_mul_over_the_whole_float_range():
    # The kernel's vectorized exp clamps its argument at +-88.4: very negative gates give 0
    # (the true value underflows), very positive ones the identity; no inf or nan either way.
    a = torch.cat((torch.linspace(-120, 120, 4001), torch.tensor([-1e30, 1e30, 0.0, -0.0])))
    g = torch.cat((a, torch.full_like(a, 1.5)))[None]
    got = ext.silu_mul(g)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, cpu_ops.silu_mul_ref(g), rtol=2e-6, atol=1e-30)


@pytest.fixture(params=["avx512", "avx2"])
def decode_kernel(request):
    """The decode kernel the test checks: AVX-512 where the CPU and the shape allow it (else
    the AVX2 one runs anyway), or AVX2 forced."""
    old = ext.set_decode_avx512(request.param == "avx512")
    yield request.param
    ext.set_decode_avx512(old)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 16), (8, 2, 32), (4, 1, 128),
                                                (6, 2, 70), (12, 3, 64), (2, 1, 128), (16, 2, 32)])
def test_paged_decode_attention(heads, kv_heads, dim, pool_dtype, decode_kernel):
    torch.manual_seed(heads)
    pool = 800
    kp = torch.randn(pool + 1, kv_heads, dim)
    kp[7] *= 30  # a few large scores: the softmax subtracts its max before the exponentials
    kp = kp.to(pool_dtype)
    vp = torch.randn(pool + 1, kv_heads, dim).to(pool_dtype)
    lens = torch.tensor([1, 17, 600, 5, 8, 64])
    idx = torch.zeros(6, 600, dtype=torch.int64)
    perm = torch.randperm(pool)[: int(lens.sum())] + 1  # scattered slots, never slot 0
    start = 0
    for b, n in enumerate(lens.tolist()):
        idx[b, :n] = perm[start:start + n]
        start += n
    idx[0, 1:] = 999_999  # cells past seq_len are never read
    q = torch.randn(6, heads, dim)
    scale = dim ** -0.5
    got = ext.paged_decode_attention(q, kp, vp, idx, lens, scale)
    want = cpu_ops.paged_decode_attention_ref(q, kp, vp, idx, lens, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # one request: work split by kv head
    one = ext.paged_decode_attention(q[2:3], kp, vp, idx[2:3], lens[2:3], scale)
    torch.testing.assert_close(one, want[2:3], rtol=1e-5, atol=1e-5)


def test_reference_fallback_when_disabled():
    kernels = cpu_ops.CpuKernels(enabled=False)
    assert not kernels.active
    x = torch.randn(2, 8)
    torch.testing.assert_close(kernels.rms_norm(x, torch.ones(8), 1e-6),
                               cpu_ops.rms_norm_ref(x, torch.ones(8), 1e-6))


@pytest.mark.parametrize("tokens,heads,dim", [(1, 12, 64), (37, 6, 32), (5, 3, 16)])
def test_rotary_on_a_strided_view(tokens, heads, dim):
    torch.manual_seed(tokens)
    fused = torch.randn(tokens, (heads + 2) * dim)  # rotary reads a view of the fused qkv output
    x = fused[:, : heads * dim].view(tokens, heads, dim)
    table = torch.randn(100, dim)
    cos, sin = table.cos(), table.sin()
    pos = torch.randint(0, 100, (tokens,))
    torch.testing.assert_close(ext.rotary(x, pos, cos, sin), cpu_ops.rotary_ref(x, pos, cos, sin),
                               rtol=1e-5, atol=1e-6)


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_load():
    """torch's cpp_extension waits forever on the lock file of a builder that was killed
    (an actor killed while compiling, say); the next load must clear it and go on."""
    import os
    import subprocess
    import sys
    csrc = os.path.join(os.path.dirname(cpu_ops.__file__), "csrc")
    stale = os.path.join(cpu_ops._build_directory(csrc), "lock")
    open(stale, "w").close()
    code = "from radixray.kernels.cpu_ops import load_extension; assert load_extension() is not None"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=900)
    assert not os.path.exists(stale)


def test_checkouts_with_the_same_sources_share_one_build(tmp_path):
    """A fresh clone of the same commit reuses the machine's build; edited sources do not."""
    import os
    import shutil
    csrc = os.path.join(os.path.dirname(cpu_ops.__file__), "csrc")
    clone = shutil.copytree(csrc, tmp_path / "clone" / "csrc")
    assert cpu_ops._build_directory(csrc) == cpu_ops._build_directory(str(clone))
    with open(clone / "kv_store.cpp", "a") as f:
        f.write("\n// edited\n")
    assert cpu_ops._build_directory(csrc) != cpu_ops._build_directory(str(clone))


def test_another_checkout_loads_the_build_without_compiling(tmp_path):
    """The issue's case: a second checkout (another path, another venv's ninja command)
    used to rebuild everything. The same sources anywhere load the machine's build."""
    import os
    import shutil
    import subprocess
    import sys
    package = os.path.dirname(os.path.dirname(cpu_ops.__file__))
    assert cpu_ops.load_extension() is not None  # the build exists
    build = cpu_ops._build_directory(os.path.join(package, "kernels", "csrc"))
    library = os.path.join(build, cpu_ops.LIBRARY)
    before = os.stat(library).st_mtime_ns
    shutil.copytree(package, tmp_path / "radixray", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import logging, radixray; logging.basicConfig(level='INFO')\n"
            f"assert radixray.__file__.startswith({str(tmp_path)!r}), radixray.__file__\n"
            "from radixray.kernels.cpu_ops import load_extension\n"
            "assert load_extension() is not None\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"Loading radixray CPU kernels ({build})" in out.stderr, out.stderr[-3000:]
    assert "compiling" not in out.stderr.lower()
    assert os.stat(library).st_mtime_ns == before
