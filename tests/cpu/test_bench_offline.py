"""``radixray bench offline``: every measured decode step carries the whole batch (the engine
runs without mixed chunks, whose riders would leave the measured span to smaller batches),
the profiler breakdown counts the time inside compiled regions as time in ops, and the
command runs end to end on a tiny model."""

from __future__ import annotations

import json
import types

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from radixray import Engine
from radixray.bench.offline import decode_step_seconds, offline_engine_options, step_breakdown
from radixray.cli import main
from radixray.engine.executor.guard_split import SplitGuards

BATCH, CONTEXT, STEPS = 4, 100, 6


def _decode_and_mixed_steps(eng: Engine) -> tuple[int, int]:
    stats = eng.scheduler.stats
    return stats.decode_steps, stats.mixed_forwards


def _measure(eng: Engine) -> tuple[float, int, int]:
    """decode_step_seconds at BATCH x CONTEXT, and the decode steps and mixed forwards it ran."""
    d0, m0 = _decode_and_mixed_steps(eng)
    seconds = decode_step_seconds(eng, BATCH, CONTEXT, STEPS, seed=1)
    d1, m1 = _decode_and_mixed_steps(eng)
    return seconds, d1 - d0, m1 - m0


def test_every_measured_decode_step_carries_the_whole_batch(tiny_llama_dir):
    # 64-token chunks: the 4 prompts of 100 tokens take 7 prefill steps
    options = {"model": tiny_llama_dir, "dtype": "float32", "chunked_prefill_size": 64}
    with Engine(**offline_engine_options(options, max_total_tokens=4096, max_batch=BATCH)) as eng:
        assert not eng.config.enable_mixed_chunk
        seconds, decode_steps, mixed = _measure(eng)
    assert seconds > 0
    assert (decode_steps, mixed) == (STEPS, 0)
    # what it guards against: with mixed chunks (the default) early prompts decode while later
    # ones prefill, so the span after the last first token holds more, smaller decode steps
    with Engine(**options, max_total_tokens=4096) as eng:
        assert eng.config.enable_mixed_chunk
        _, decode_steps, mixed = _measure(eng)
    assert mixed > 0 and decode_steps > STEPS


def _gated(model, batch):
    return torch.nn.functional.silu(batch.x @ model.w) + 1


def test_step_breakdown_counts_compiled_regions_as_ops():
    """As the engine calls its compiled decode step: through SplitGuards, whose direct calls
    run the inductor graph without dynamo's frame around it."""
    model = torch.nn.Module()
    model.register_buffer("w", torch.randn(64, 64))
    fn = types.FunctionType(_gated.__code__.replace(), _gated.__globals__, "_gated")
    step = SplitGuards(torch.compile(fn, fullgraph=True, backend="inductor"), fn)
    batch = types.SimpleNamespace(x=torch.randn(64, 64))
    step(model, batch)  # compiled here, through dynamo
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with record_function("decode_step"):
                step(model, batch)
                torch.mm(batch.x, batch.x)  # an op outside the compiled graph
    assert step.direct_calls == 3
    got = step_breakdown(prof.events())
    # the matmul inside the compiled graph and the one after it
    assert got["ops_per_step"] == 2
    assert 0 < got["aten_ms"] <= got["step_ms"]
    assert got["other_ms"] == got["step_ms"] - got["aten_ms"]


def test_bench_offline_end_to_end(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "offline.json"
    rc = main(["bench", "offline", "--model", tiny_llama_dir, "--dtype", "float32",
               "--batch-sizes", "1,2", "--decode-steps", "4", "--context-len", "24",
               "--prefill-prompts", "2", "--prefill-len", "32", "--repeats", "1",
               "--output", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert [d["batch"] for d in r["decode"]] == [1, 2]
    assert all(d["step_ms"] > 0 and d["floor_ms"] > 0 for d in r["decode"])
    assert r["prefill"]["tokens_per_s"] > 0
    assert [o["batch"] for o in r["overhead"]] == [1, 2]
    assert all(o["aten_ms"] > 0 and o["ops_per_step"] > 0 for o in r["overhead"])
    assert "prefill 2 x 32 tokens" in capsys.readouterr().out
