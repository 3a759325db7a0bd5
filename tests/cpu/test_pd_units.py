"""Prefill-decode pieces without engines: config roles, pair routing, copy spans."""

from __future__ import annotations

import pytest
import torch

from radixray.cluster.config import ConfigError, ServeConfig
from radixray.engine.disaggregation.layout import HeadPiece, copy_spans, head_plan, slot_runs
from radixray.engine.disaggregation.messages import KVEndpoint, KVLayout, PDBootstrap


def test_roles_from_config():
    cfg = ServeConfig.parse({"fleet": {"prefill_workers": 2, "decode_workers": 1,
                                       "decode_engine": {"max_running_requests": 8}}})
    assert cfg.fleet.roles() == ["prefill", "prefill", "decode"]
    assert cfg.fleet.workers == 0
    assert cfg.engine_options_for("decode")["max_running_requests"] == 8
    assert cfg.engine_options_for("decode")["disaggregation_mode"] == "decode"
    assert cfg.engine_options_for("prefill")["max_running_requests"] is None
    assert ServeConfig.parse({}).fleet.roles() == ["unified"]


@pytest.mark.parametrize("fleet, words", [
    ({"workers": 2, "prefill_workers": 1, "decode_workers": 1}, "cannot be mixed"),
    ({"prefill_workers": 1}, "fleet.decode_workers >= 1"),
    ({"prefill_workers": 1, "decode_workers": 1, "decode_engine": {"nope": 1}}, "nope"),
    ({"prefill_workers": 1, "decode_workers": 1, "prefill_engine": {"max_total_tokens": 1}},
     "prefill_engine"),
    ({"workers": 2, "decode_engine": {"max_total_tokens": 64}}, "apply only with"),
])
def test_bad_role_config_names_the_field(fleet, words):
    with pytest.raises(ConfigError, match=words):
        ServeConfig.parse({"fleet": fleet})


def test_disaggregation_mode_is_not_a_fleet_engine_option():
    with pytest.raises(ConfigError, match="fleet.prefill_workers"):
        ServeConfig.parse({"engine": {"disaggregation_mode": "prefill"}})


def test_pair_routing_prefers_cached_prefill_and_least_loaded_decode():
    import asyncio

    from radixray.actors.router import RouterActor
    from radixray.cluster.routing import NoWorkerAvailable, RouterSettings

    async def run():
        r = RouterActor(RouterSettings())
        await r.set_workers(["w0", "w1", "w2", "w3"], {"w0": "prefill", "w1": "prefill",
                                                       "w2": "decode", "w3": "decode"})
        p1, d1, _ = await r.pick_pair("a long shared prefix " * 4 + "one")
        p2, d2, reason = await r.pick_pair("a long shared prefix " * 4 + "two")
        assert p1 == p2 and reason == "cache_match"  # the prefill worker that saw it
        assert {d1, d2} == {"w2", "w3"}  # least load spreads decodes
        await r.release(d1, True)
        _, d3, _ = await r.pick_pair("x", exclude=[p1])
        assert d3 == d1
        with pytest.raises(NoWorkerAvailable, match="no decode worker"):
            await r.pick_pair("y", exclude=["w2", "w3"])
        state = await r.state()
        assert state["decode"]["policy"] == "least_load" and sum(state["pairs"].values()) == 3
    asyncio.run(run())


def test_slot_runs_group_contiguous_both_sides():
    src = torch.tensor([5, 6, 7, 9, 10, 20])
    dst = torch.tensor([1, 2, 3, 4, 5, 6])
    s0, d0, n = slot_runs(src, dst)
    assert s0.tolist() == [5, 9, 20] and d0.tolist() == [1, 4, 6] and n.tolist() == [3, 2, 1]
    with pytest.raises(ValueError, match="destination slots"):
        slot_runs(src, dst[:2])


def test_copy_spans_cover_every_layer_key_and_value():
    a = KVLayout((1000, 2000), (3000, 4000), 16, "float32")
    b = KVLayout((10_000, 20_000), (30_000, 40_000), 16, "float32")
    src, dst, lengths = copy_spans(a, torch.tensor([2, 3]), b, torch.tensor([7, 8]))
    assert src == [1032, 2032, 3032, 4032] and dst == [10_112, 20_112, 30_112, 40_112]
    assert lengths == [32] * 4
    assert a.mismatch(KVLayout((1,), (2,), 16, "float32")) is not None


def _group(*heads: tuple[int, ...], head_bytes: int = 8) -> KVEndpoint:
    """A worker whose rank r holds KV heads ``heads[r]`` (addresses made up)."""
    layouts = tuple(KVLayout((1000 * (r + 1),), (2000 * (r + 1),), head_bytes * len(h),
                             "float32", h) for r, h in enumerate(heads))
    return KVEndpoint(tuple(f"s{r}" for r in range(len(heads))), layouts)


def test_head_plan_reslices_kv_heads_between_tp_sizes():
    one, two = _group((0, 1)), _group((0,), (1,))
    assert head_plan(one, 0, two) == {0: [HeadPiece(0, 0, 1)], 1: [HeadPiece(1, 0, 1)]}
    assert head_plan(two, 0, one) == {0: [HeadPiece(0, 0, 1)]}
    assert head_plan(two, 1, one) == {0: [HeadPiece(0, 1, 1)]}
    assert head_plan(one, 0, one) == {0: [HeadPiece(0, 0, 2)]}  # whole rows
    # TP 4 over 2 KV heads: each head on two ranks; the writers are spread round robin
    four = _group((0,), (0,), (1,), (1,))
    plans = [head_plan(four, r, two) for r in range(4)]
    assert plans == [{0: [HeadPiece(0, 0, 1)]}, {}, {}, {1: [HeadPiece(0, 0, 1)]}]
    into_four = [head_plan(two, r, four) for r in range(2)]
    assert into_four == [{0: [HeadPiece(0, 0, 1)], 1: [HeadPiece(0, 0, 1)]},
                         {2: [HeadPiece(0, 0, 1)], 3: [HeadPiece(0, 0, 1)]}]
    assert two.mismatch(four) is None and four.mismatch(one) is None
    assert "different KV heads" in one.mismatch(_group((0,), (2,)))
    assert "bytes per KV head" in one.mismatch(_group((0, 1), head_bytes=4))


def test_a_piece_of_each_row_is_one_span_per_slot_layer_and_buffer():
    src = KVLayout((1000,), (5000,), 16, "float32", (0, 1))  # two heads of 8 bytes per slot
    dst = KVLayout((100,), (900,), 8, "float32", (1,))
    s, d, n = copy_spans(src, torch.tensor([2, 3]), dst, torch.tensor([7, 8]),
                         HeadPiece(1, 0, 1))
    assert s == [1000 + 32 + 8, 1000 + 48 + 8, 5000 + 32 + 8, 5000 + 48 + 8]
    assert d == [100 + 56, 100 + 64, 900 + 56, 900 + 64] and n == [8] * 4


def test_bootstrap_room_bounds():
    PDBootstrap(2**63 - 1, "w")
    for bad in (-1, 2**63, "7", True):
        with pytest.raises(ValueError, match="bootstrap_room"):
            PDBootstrap(bad, "w")


def test_populating_a_pool_keeps_its_contents():
    from radixray.engine.mem_cache.hugepages import empty_huge, populate_rows
    bufs = [empty_huge((3000, 2, 8), torch.float32) for _ in range(3)]
    bufs[1][2999] = 7.0
    bufs[2][0] = -1.0
    populate_rows(bufs, 1024)
    assert float(bufs[1][2999].sum()) == 7.0 * 16 and float(bufs[2][0].sum()) == -16.0


def test_interference_workload_and_class_stats(tiny_llama_dir):
    from radixray.bench.datasets import build_interference, load_tokenizer
    from radixray.bench.interference import class_stats, transfer_fields
    from radixray.bench.serve_metrics import RequestRecord
    items = build_interference(load_tokenizer(tiny_llama_dir), 8, 16, 4, 2, 128, 2, seed=3)
    assert [it.group for it in items] == [0, 1, 0, 0, 0, 0, 1, 0, 0, 0]
    assert all(abs(it.prompt_len - 128) <= 4 for it in items if it.group)
    recs = [RequestRecord(index=it.index, success=True, ttft=0.1 * (1 + it.group * 9),
                          itl=[0.01, 0.02]) for it in items]
    stats = class_stats(recs, {it.index: it.group for it in items})
    assert stats["median_ttft_ms_long"] == pytest.approx(1000) and \
        stats["median_ttft_ms_short"] == pytest.approx(100)
    fields = transfer_fields({"kv_transfer_rate": 5e8}, 1e9)
    assert fields["kv_transfer_vs_loopback"] == 0.5 and fields["kv_transfer_gb_s"] == 0.5


def test_kv_transfer_bench_writes_a_model_shaped_pool(tiny_llama_dir):
    from radixray.bench.kv_transfer import run
    from radixray.engine.weights.loader import resolve_model
    out = run(tiny_llama_dir, tokens=64, repeats=2, loopback_chunk=4 << 20)
    layers = resolve_model(tiny_llama_dir).config.num_hidden_layers
    assert out["spans"] == 2 * layers and out["kv_gb_s_median"] > 0 and out["kv_vs_loopback"] > 0


def test_kv_transfer_bench_re_slices_into_tensor_parallel_decode_ranks(tiny_llama_dir):
    """Into two decode ranks each holding half the KV heads: staged, one span per layer,
    buffer and rank (the slots are contiguous and fit one chunk), every byte of the rows
    still sent once; without the stager one span per slot, layer, buffer and rank (more
    than one Mooncake batch takes: the transport splits them)."""
    from radixray.bench.kv_transfer import run
    from radixray.engine.disaggregation.mooncake import MAX_SPANS_PER_BATCH
    from radixray.engine.weights.loader import resolve_model
    tokens = 400
    whole = run(tiny_llama_dir, tokens=tokens, repeats=2, loopback_chunk=4 << 20)
    split = run(tiny_llama_dir, tokens=tokens, repeats=2, loopback_chunk=4 << 20,
                decode_tp_size=2)
    layers = resolve_model(tiny_llama_dir).config.num_hidden_layers
    assert not whole["staged"] and whole["spans"] == 2 * layers
    assert split["decode_tp_size"] == 2 and split["bytes"] == whole["bytes"]
    assert split["staged"] and split["spans"] == 2 * layers * 2 and split["kv_gb_s_median"] > 0
    assert split["unstaged_spans"] == tokens * 2 * layers * 2
    plain = run(tiny_llama_dir, tokens=tokens, repeats=1, loopback_chunk=4 << 20,
                decode_tp_size=2, staging=False)
    assert not plain["staged"] and plain["bytes"] == whole["bytes"]
    assert plain["spans"] == tokens * 2 * layers * 2
    assert plain["spans"] / 2 > MAX_SPANS_PER_BATCH  # each rank's write spans batches


def test_a_router_used_directly_starts_no_ray():
    """RouterActor outside an actor (as above) must not start a local Ray in this process
    (a later ray.init would then fail: 'called ray.init twice')."""
    import asyncio

    import ray

    from radixray.actors.router import RouterActor
    from radixray.cluster.routing import RouterSettings

    async def run():
        return RouterActor(RouterSettings()).restarted
    assert asyncio.run(run()) is False
    assert not ray.is_initialized()


def test_per_role_tp_size_flags_reach_each_roles_engine_and_resources():
    import argparse

    from radixray.serve import serve_cli
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--prefill-workers", "1", "--decode-workers", "1",
                              "--prefill-tp-size", "2", "--decode-tp-size", "4"])
    cfg = serve_cli.config_from_args(args)
    assert cfg.engine_options_for("prefill")["tp_size"] == 2
    assert cfg.engine_options_for("decode")["tp_size"] == 4
    # one bundle per rank: the prefill slot's two, then the decode slot's four
    assert cfg.slot_bundles() == [[0, 1], [2, 3, 4, 5]]
    assert cfg.worker_bundles() == [{"CPU": cfg.server.worker_num_cpus}] * 6


def _kv_pools(ranks: list[tuple[int, ...]], layers: int, slots: int, dim: int,
              dtype: torch.dtype, transport, fill: bool):
    """One pool per rank holding KV heads ``ranks[r]``, registered with ``transport``:
    (per rank the ``(k_buffers, v_buffers)``, their endpoint on ``transport``)."""
    from radixray.engine.disaggregation.layout import pool_layout
    pools, layouts = [], []
    for heads in ranks:
        bufs = [torch.randn(slots, len(heads), dim).to(dtype) if fill
                else torch.zeros(slots, len(heads), dim, dtype=dtype) for _ in range(2 * layers)]
        for b in bufs:
            transport.register(b.data_ptr(), b.numel() * b.element_size())
        pools.append((bufs[:layers], bufs[layers:]))
        layouts.append(pool_layout(bufs[:layers], bufs[layers:], heads))
    return pools, KVEndpoint((transport.session,) * len(ranks), tuple(layouts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("src_ranks, dst_ranks", [
    ([(0, 1, 2, 3)], [(0,), (1,), (2,), (3,)]),  # TP 1 -> TP 4: a head of four, staged
    ([(0, 1, 2, 3)], [(0, 1), (2, 3)]),  # TP 1 -> TP 2: two heads of four, staged
    ([(0, 1), (2, 3)], [(0, 1, 2, 3)]),  # TP 2 -> TP 1: per-slot spans (no scatter)
])
def test_staged_re_sliced_writes_land_every_head_in_place(dtype, src_ranks, dst_ranks,
                                                          monkeypatch):
    """Real transports, non-contiguous slots on both sides, chunks of 3 slots gathered a
    row or two at a time: each destination row holds exactly the source rows' heads it
    should (bitwise), the slots not written stay zero, and one staging buffer is
    registered, reused, then released."""
    from radixray.engine.disaggregation import staging
    from radixray.engine.disaggregation.mooncake import MooncakeTransport
    from radixray.engine.disaggregation.sender import write_share
    from radixray.engine.disaggregation.staging import SliceStager, stageable
    monkeypatch.setattr(staging, "SERIAL_ELEMENTS", 64)  # 64 bytes: 1-4 rows per gather
    layers, slots, dim = 3, 40, 8
    src_slots = torch.tensor([3, 4, 5, 9, 2, 17, 18, 19, 20, 30, 31])
    dst_slots = torch.tensor([1, 2, 7, 8, 9, 10, 11, 25, 26, 27, 39])
    sender, receiver = MooncakeTransport(), MooncakeTransport()
    try:
        src_pools, src = _kv_pools(src_ranks, layers, slots, dim, dtype, sender, fill=True)
        dst_pools, dst = _kv_pools(dst_ranks, layers, slots, dim, dtype, receiver, fill=False)
        before = len(sender._registered)
        staged = False
        for rank, (k_bufs, v_bufs) in enumerate(src_pools):
            stager = SliceStager(sender, k_bufs, v_bufs, max_bytes=4 << 10, chunk_slots=3)
            want = src_slots.numel() * 2 * layers * src.layouts[rank].slot_bytes
            written = write_share(sender, src, rank, src_slots, dst, dst_slots, stager)
            staged |= stager.spans > 0
            assert written == want  # every head of the rank's rows, written once
            assert len(sender._registered) == before + (stager.spans > 0)
            stager.close()
            assert len(sender._registered) == before
        assert staged == stageable(src.layouts[0], dst.layouts[0],
                                   head_plan(src, 0, dst)[0][0]) == (len(src_ranks) == 1)
        if staged:  # chunks of destination slots [1 2|7] [8 9 10] [11|25 26] [27|39]: 7 runs
            assert stager.spans == 7 * 2 * layers * len(dst_ranks)
        # the model's KV heads, whole: per layer and buffer [slots, heads, dim]
        model = [torch.cat([pool[i // layers][i % layers] for pool in src_pools], dim=1)
                 for i in range(2 * layers)]
        untouched = torch.ones(slots, dtype=torch.bool)
        untouched[dst_slots] = False
        for (k_bufs, v_bufs), heads in zip(dst_pools, dst_ranks):
            for i, buf in enumerate(k_bufs + v_bufs):
                expected = model[i][src_slots][:, list(heads)]
                assert torch.equal(buf[dst_slots], expected), (heads, i)
                assert not buf[untouched].any()
    finally:
        sender.close()
        receiver.close()
