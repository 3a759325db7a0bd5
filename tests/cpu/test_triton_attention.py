"""The triton paged-attention kernels against their torch references, run by triton's
interpreter on the CPU (TRITON_INTERPRET=1, set before triton is imported). The
interpreter is slow, so shapes are tiny; lengths are chosen to cross the kernels' tiles."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from radixray.kernels import attention_reference as ref  # noqa: E402
from radixray.kernels import triton_attention as ta  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"

# (q dtype, pool dtype, k_scale, v_scale): fp8 pools with non-1 scales.
DTYPES = {
    "fp32": (torch.float32, torch.float32, None, None),
    "bf16": (torch.bfloat16, torch.bfloat16, None, None),
    "e5m2": (torch.bfloat16, torch.float8_e5m2, 2.0, 0.5),
    "e4m3": (torch.float32, torch.float8_e4m3fn, 0.05, 0.02),
}
# (kv heads, query heads per kv head): GQA ratios 1, 3 and 8.
GQA = {"mha": (2, 1), "gqa3": (2, 3), "gqa8": (1, 8)}


def _tol(q_dtype):
    if q_dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-5}
    return {"rtol": 2e-2, "atol": 2e-2}


class Paged:
    """A K and a V pool holding requests of ``lens`` tokens in shuffled, non-contiguous
    pages (with unused pages between), and their page table."""

    def __init__(self, lens, page_size, kv_heads, head_dim, pool_dtype, k_scale, v_scale,
                 index_dtype=torch.int32, seed=0):
        gen = torch.Generator().manual_seed(seed)
        pages_per = [-(-n // page_size) for n in lens]
        num_pages = 2 * sum(pages_per) + 3
        order = torch.randperm(num_pages, generator=gen)
        shape = (num_pages, page_size, kv_heads, head_dim)
        self.k = ref.to_pool(torch.randn(shape, generator=gen), pool_dtype, k_scale).to(DEVICE)
        self.v = ref.to_pool(torch.randn(shape, generator=gen), pool_dtype, v_scale).to(DEVICE)
        self.indices = order[: sum(pages_per)].to(index_dtype).to(DEVICE)
        self.indptr = torch.tensor([0] + pages_per).cumsum(0).to(index_dtype).to(DEVICE)
        self.lens = torch.tensor(lens, dtype=index_dtype, device=DEVICE)


def _decode(lens, page_size, gqa, dtype, num_kv_splits=None, head_dim=32, index_dtype=torch.int32):
    kv_heads, group = GQA[gqa]
    q_dtype, pool_dtype, k_scale, v_scale = DTYPES[dtype]
    kv = Paged(lens, page_size, kv_heads, head_dim, pool_dtype, k_scale, v_scale, index_dtype)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=torch.Generator().manual_seed(1))
    q = q.to(q_dtype).to(DEVICE)
    args = (q, kv.k, kv.v, kv.indptr, kv.indices, kv.lens, head_dim ** -0.5, k_scale, v_scale)
    out = ta.decode_attention(*args, num_kv_splits=num_kv_splits)
    return out, ref.decode_attention_ref(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("gqa", GQA)
def test_decode_matches_reference(gqa, page_size, dtype):
    # 70 tokens: two K/V tiles, not a multiple of the page size.
    out, expected = _decode([37, 70, 5], page_size, gqa, dtype)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out, expected, **_tol(out.dtype))


@pytest.mark.parametrize("dtype", ["fp32", "e5m2"])
def test_decode_splits_agree_with_one_split(dtype):
    lens = [150, 3, 64]  # 3 tokens over 4 or 16 splits leaves splits empty
    one, expected = _decode(lens, 16, "gqa3", dtype, num_kv_splits=1)
    torch.testing.assert_close(one, expected, **_tol(one.dtype))
    for splits in (3, 4, 16):
        many, _ = _decode(lens, 16, "gqa3", dtype, num_kv_splits=splits)
        assert not many.isnan().any()
        torch.testing.assert_close(many, one, **_tol(one.dtype))


def test_decode_empty_request_gives_zeros_not_nan():
    for splits in (1, 4):
        out, expected = _decode([0, 20, 0], 16, "gqa8", "fp32", num_kv_splits=splits,
                                index_dtype=torch.int64)
        assert not out.isnan().any()
        assert (out[0] == 0).all() and (out[2] == 0).all()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_default_split_count():
    assert ta.default_num_kv_splits(0) == 1
    assert ta.default_num_kv_splits(ta.TOKENS_PER_SPLIT) == 1
    assert ta.default_num_kv_splits(ta.TOKENS_PER_SPLIT * 3) == 4  # a power of two
    assert ta.default_num_kv_splits(10**7) == ta.MAX_KV_SPLITS


def test_decode_three_dimensional_pool_is_page_size_one():
    kv = Paged([9, 4], 1, 2, 16, torch.float32, None, None)
    q = torch.randn(2, 4, 16, device=DEVICE)
    args = (q, kv.k[:, 0], kv.v[:, 0], kv.indptr, kv.indices, kv.lens, 0.25)
    torch.testing.assert_close(ta.decode_attention(*args), ref.decode_attention_ref(*args),
                               rtol=1e-5, atol=1e-5)


def _extend(new_lens, prefix_lens, page_size, gqa, dtype, head_dim=32, index_dtype=torch.int32):
    kv_heads, group = GQA[gqa]
    q_dtype, pool_dtype, k_scale, v_scale = DTYPES[dtype]
    kv = Paged(prefix_lens, page_size, kv_heads, head_dim, pool_dtype, k_scale, v_scale, index_dtype)
    gen = torch.Generator().manual_seed(2)
    total = sum(new_lens)
    q = torch.randn(total, kv_heads * group, head_dim, generator=gen).to(q_dtype).to(DEVICE)
    k_new = torch.randn(total, kv_heads, head_dim, generator=gen).to(q_dtype).to(DEVICE)
    v_new = torch.randn(total, kv_heads, head_dim, generator=gen).to(q_dtype).to(DEVICE)
    qo_indptr = torch.tensor([0] + new_lens).cumsum(0).to(index_dtype).to(DEVICE)
    args = (q, k_new, v_new, kv.k, kv.v, qo_indptr, kv.indptr, kv.indices, kv.lens,
            head_dim ** -0.5, k_scale, v_scale)
    return ta.extend_attention(*args), ref.extend_attention_ref(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("gqa", GQA)
def test_extend_matches_reference(gqa, page_size, dtype):
    # Ragged: no prefix; a prefix of three tiles (> 2 * EXTEND_BLOCK_N) and not a multiple
    # of the page size; a one-token extend over a short prefix.
    out, expected = _extend([6, 9, 1], [0, 2 * ta.EXTEND_BLOCK_N + 5, 20], page_size, gqa, dtype)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out, expected, **_tol(out.dtype))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_extend_new_tokens_span_several_query_blocks(dtype):
    # More new tokens than EXTEND_BLOCK_M: later blocks see the earlier blocks' keys, and
    # the grid (sized for the longest request) has blocks past the short ones' ends.
    long = ta.EXTEND_BLOCK_M + 7
    out, expected = _extend([long, 3], [17, 0], 16, "gqa3", dtype, head_dim=16,
                            index_dtype=torch.int64)
    torch.testing.assert_close(out, expected, **_tol(out.dtype))


def test_references_agree_with_sdpa():
    """The references themselves: no prefix is causal SDPA, decode is plain SDPA."""
    import torch.nn.functional as F

    q, k, v = (torch.randn(9, 4, 16) for _ in range(3))
    empty = torch.zeros(1, 1, 4, 16)
    no_pages = torch.zeros(0, dtype=torch.int32)
    got = ref.extend_attention_ref(q, k, v, empty, empty, torch.tensor([0, 9]), torch.tensor([0, 0]),
                                   no_pages, torch.tensor([0]), 0.25)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          is_causal=True, scale=0.25).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # decode of the last token over a 9-token page-size-1 pool, pages in order
    got = ref.decode_attention_ref(q[-1:], k, v, torch.tensor([0, 9]), torch.arange(9),
                                   torch.tensor([9]), 0.25)
    torch.testing.assert_close(got[0], want[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_store_kv_matches_reference(page_size, dtype):
    q_dtype, pool_dtype, k_scale, v_scale = DTYPES[dtype]
    gen = torch.Generator().manual_seed(3)
    n, num_pages = 7, 16 // page_size
    pools = [torch.zeros(num_pages, page_size, 3, 16, dtype=pool_dtype, device=DEVICE)
             for _ in range(4)]
    slots = torch.randperm(16, generator=gen)[:n].to(DEVICE)  # any order, any page
    k = (torch.randn(n, 3, 16, generator=gen) * 4).to(q_dtype).to(DEVICE)
    v = (torch.randn(n, 3, 16, generator=gen) * 4).to(q_dtype).to(DEVICE)
    ta.store_kv(pools[0], pools[1], slots, k, v, k_scale, v_scale)
    ref.store_kv_ref(pools[2], pools[3], slots, k, v, k_scale, v_scale)
    for got, want in ((pools[0], pools[2]), (pools[1], pools[3])):
        assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                           want.view(torch.uint8) if want.element_size() == 1 else want)
        # untouched slots stay zero
        assert int((got.float() != 0).flatten(0, 1).any(-1).any(-1).sum()) <= n


@pytest.mark.parametrize("pool_dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_store_kv_saturates_fp8_instead_of_overflowing(pool_dtype):
    limit = ref.FP8_MAX[pool_dtype]
    k = torch.tensor([[[1e9, -1e9, 1.0, limit * 4]]], device=DEVICE)
    pools = [torch.zeros(4, 1, 4, dtype=pool_dtype, device=DEVICE) for _ in range(2)]
    ta.store_kv(pools[0], pools[1], torch.tensor([2], device=DEVICE), k, k, 2.0, None)
    stored_k, stored_v = pools[0][2, 0].float(), pools[1][2, 0].float()
    assert stored_k.isfinite().all() and stored_v.isfinite().all()
    assert stored_k.tolist() == [limit, -limit, 0.5, limit]
    assert stored_v.tolist() == [limit, -limit, 1.0, limit]


def test_store_then_decode_round_trip():
    """What store_kv writes, decode_attention reads back through the same page table."""
    page_size, kv_heads, head_dim = 4, 1, 16
    k_pool = torch.zeros(6, page_size, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
    v_pool = torch.zeros_like(k_pool)
    pages = torch.tensor([4, 1, 3], device=DEVICE)  # 10 tokens over three pages
    slots = (pages[:, None] * page_size + torch.arange(page_size, device=DEVICE)).flatten()[:10]
    k = torch.randn(10, kv_heads, head_dim, device=DEVICE)
    v = torch.randn(10, kv_heads, head_dim, device=DEVICE)
    ta.store_kv(k_pool, v_pool, slots, k, v)
    q = torch.randn(1, 8, head_dim, device=DEVICE)
    out = ta.decode_attention(q, k_pool, v_pool, torch.tensor([0, 3], device=DEVICE), pages,
                              torch.tensor([10], device=DEVICE), 0.25)
    expected = torch.softmax(torch.einsum("hd,nd->hn", q[0], k[:, 0].bfloat16().float()) * 0.25, -1)
    torch.testing.assert_close(out[0], expected @ v[:, 0].bfloat16().float(), rtol=1e-5, atol=1e-5)


def test_importing_the_kernels_package_does_not_import_triton():
    code = "import sys, radixray.kernels; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))))
