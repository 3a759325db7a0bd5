"""Weights and KV pool live in huge-page-advised memory, and packing keeps parameters intact."""

from __future__ import annotations

import sys

import pytest
import torch

from radixray.engine.hugepages import empty_huge, pack_parameters_into_huge_pages


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

    base = anon_huge_kb()
    t = empty_huge((16 * 2**20,), torch.float32)  # 64 MiB, untouched
    t.fill_(1.0)
    assert anon_huge_kb() - base >= 32 * 1024
