"""Weights and KV pool live in huge-page-advised memory, and packing keeps parameters intact."""

from __future__ import annotations

import sys

import pytest
import torch

from radixray.engine.mem_cache.hugepages import (
    advise_huge_pages,
    empty_huge,
    pack_parameters_into_huge_pages,
)


def test_packing_keeps_values_identity_and_ties():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(100, 32)
    model = torch.nn.ModuleDict({"emb": emb, "lin": torch.nn.Linear(32, 7)})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = {n: id(p) for n, p in model.named_parameters()}
    tied = model["emb"].weight
    assert pack_parameters_into_huge_pages(model) >= sum(p.numel() * 4 for p in model.parameters())
    for n, p in model.named_parameters():
        assert id(p) == ids[n]
        torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 1, "all parameters share one buffer"
    assert tied is model["emb"].weight


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux-only")
def test_empty_huge_gets_huge_pages_when_the_kernel_allows():
    mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off on this machine")

    def anon_huge_kb() -> int:
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
        return 0

    def thp_faults() -> dict[str, int]:
        stats = dict(line.split() for line in open("/proc/vmstat"))
        return {k: int(stats.get(k, 0)) for k in ("thp_fault_alloc", "thp_fault_fallback")}

    base, faults = anon_huge_kb(), thp_faults()
    t = torch.empty(16 * 2**20, dtype=torch.float32)  # 64 MiB, untouched
    assert advise_huge_pages(t), "madvise(MADV_HUGEPAGE) failed"
    t.fill_(1.0)
    after = thp_faults()
    got = after["thp_fault_alloc"] - faults["thp_fault_alloc"]
    # Whether the kernel has free 2 MiB pages to give (memory fragmented by earlier work may
    # leave it none) is the machine's state, not the advice's.
    if got < 16:
        pytest.skip(f"the kernel gave {got} huge pages on fault (fallbacks: "
                    f"{after['thp_fault_fallback'] - faults['thp_fault_fallback']})")
    assert anon_huge_kb() - base >= 32 * 1024
    assert empty_huge((4,), torch.float32).shape == (4,)
