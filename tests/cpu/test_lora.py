"""Multi-LoRA serving in the engine: two PEFT adapters made here on the tiny random Llama.

Greedy tokens of each adapter equal Hugging Face's with the adapter merged into the weights
(peft's merge_and_unload), with requests of both adapters and of none in one batch, eager
and through the compiled decode step (whose tokens and logprobs are the eager step's); the
batched LoRA matmul, grouped and segmented (decode), equals its row-by-row reference; adapters load and unload through the
engine's verbs; the radix cache never shares KV across adapters.
"""

from __future__ import annotations

import os

import pytest
import torch
from model_fixtures import (
    assert_greedy_equal,
    hf_greedy,
    merged_hf,
    random_prompts,
)

from radixray import Engine
from radixray.kernels.lora import (
    MIN_PART_ROWS,
    MIN_RUN_ROWS,
    LoraRows,
    LoraSegments,
    lora_add,
    lora_add_reference,
    lora_add_segments,
)

NEW_TOKENS = 12
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


@pytest.fixture(scope="module")
def lora_eng(tiny_llama_dir, lora_adapters):
    paths = [f"{name}={path}" for name, path in lora_adapters.items()]
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=8192,
                check_kv_conservation=True, lora_paths=paths) as engine:
        yield engine
        engine.check_kv_conservation()


@pytest.fixture(scope="module")
def references(tiny_llama_dir, lora_adapters):
    """HF greedy tokens (and top-2 gaps) per (adapter or None, prompt index)."""
    prompts = random_prompts(256)[:6]
    out = {}
    for name in (None, *lora_adapters):
        hf = merged_hf(tiny_llama_dir, lora_adapters.get(name))
        for i, p in enumerate(prompts):
            out[(name, i)] = hf_greedy(hf, p, NEW_TOKENS)
    return prompts, out


def test_the_adapters_change_the_output(references):
    _, refs = references
    for i in range(6):
        assert refs[("alpha", i)][0] != refs[(None, i)][0] or refs[("beta", i)][0] != refs[(None, i)][0]


def test_one_mixed_batch_equals_hf_with_each_adapter_merged(lora_eng, references):
    prompts, refs = references
    choice = [None, "alpha", "beta", "alpha", None, "beta"]
    batch = [p for p in prompts] + [prompts[1], prompts[2]]
    loras = choice + ["beta", None]
    orders = []  # each step's running requests, as their adapter slots
    lora_eng.call_in_loop(lambda s: setattr(s, "on_step", lambda sched: orders.append(
        [sched.runner.lora.slot_index(r.lora) for r in sched.queues.running])))
    try:
        outs = lora_eng.generate(input_ids=batch, sampling_params=GREEDY, lora_path=loras)
    finally:
        lora_eng.call_in_loop(lambda s: setattr(s, "on_step", None))
    for i, (out, name) in enumerate(zip(outs, loras)):
        p = i if i < 6 else (1 if i == 6 else 2)
        ref, gaps = refs[(name, p)]
        assert_greedy_equal(out["output_ids"], ref, gaps, f"adapter {name} prompt {p}")
    # the running batch stays grouped by slot (base first), so each adapter's decode rows
    # are one run of the batch (kernels/lora.py's runs form)
    assert len(max(orders, key=len)) == len(batch)
    assert all(order == sorted(order) for order in orders), orders


def test_one_slot_serves_a_mixed_batch_by_turns(tiny_llama_dir, lora_adapters, references):
    prompts, refs = references
    loras = ["alpha", "beta", None, "beta", "alpha"]
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096,
                check_kv_conservation=True, enable_lora=True, max_lora_rank=8,
                max_loras_per_batch=1) as eng:
        for name, path in lora_adapters.items():
            eng.load_lora_adapter(name, path)
        outs = eng.generate(input_ids=prompts[:5], sampling_params=GREEDY, lora_path=loras)
        for i, (out, name) in enumerate(zip(outs, loras)):
            assert_greedy_equal(out["output_ids"], *refs[(name, i)], f"1 slot: {name} prompt {i}")
        # the one slot took alpha, then beta (once alpha's requests finished), at least
        slots = eng.call_in_loop(lambda s: (s.runner.lora.loads, s.runner.lora.slot_names))
        assert slots[0] >= 2 and slots[1] in (["alpha"], ["beta"])
        assert eng.snapshot().adapters_held == slots[1]


def test_the_batched_lora_matmul_equals_its_reference():
    gen = torch.Generator().manual_seed(0)
    slots, rank, d_in, d_out, rows = 3, 6, 40, 24, 17
    a = torch.randn(slots, rank, d_in, generator=gen)
    b = torch.randn(slots, d_out, rank, generator=gen)
    scalings = torch.tensor([0.5, 2.0, 1.25])
    x = torch.randn(rows, d_in, generator=gen)
    base = torch.randn(rows, d_out, generator=gen)
    row_slots = torch.tensor([-1, -1, 0, 0, 0, 2, 2, 1, -1, 1, 1, 1, 0, 2, -1, -1, 2])
    want = lora_add_reference(base, x, a, b, scalings, row_slots)
    got = lora_add(base.clone(), x, a, b, scalings, LoraRows.of(row_slots))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[row_slots < 0], base[row_slots < 0])  # no adapter: untouched
    same = torch.full((rows,), 1)
    rows_all = LoraRows.of(same[:MIN_RUN_ROWS - 1])
    assert rows_all.runs == [(1, 0, MIN_RUN_ROWS - 1)] and not rows_all.groups  # no gather
    torch.testing.assert_close(lora_add(base[:MIN_RUN_ROWS - 1].clone(), x[:MIN_RUN_ROWS - 1],
                                        a, b, scalings, rows_all),
                               lora_add_reference(base[:MIN_RUN_ROWS - 1], x[:MIN_RUN_ROWS - 1],
                                                  a, b, scalings, same[:MIN_RUN_ROWS - 1]),
                               rtol=1e-5, atol=1e-5)


def test_a_long_run_of_one_adapter_is_updated_in_place_and_the_rest_grouped():
    """A prefill chunk (a run of one adapter) beside decode riders of several: the run's
    update goes through views, the riders' through their slots' groups; both equal the
    reference, rows without an adapter untouched."""
    gen = torch.Generator().manual_seed(2)
    slots, rank, d_in, d_out = 4, 8, 40, 24
    a = torch.randn(slots, rank, d_in, generator=gen)
    b = torch.randn(slots, d_out, rank, generator=gen)
    scalings = torch.tensor([0.5, 2.0, 1.25, 1.0])
    riders = [2, -1, 0, 2, 1, -1]
    run = [3] * MIN_RUN_ROWS
    short = [0] * (MIN_RUN_ROWS - 1)  # one row short of a run: grouped with slot 0's riders
    row_slots = torch.tensor(riders + run + short + [1] * (MIN_RUN_ROWS + 3))
    x = torch.randn(len(row_slots), d_in, generator=gen)
    base = torch.randn(len(row_slots), d_out, generator=gen)
    plan = LoraRows.of(row_slots)
    r0 = len(riders)
    r1 = r0 + MIN_RUN_ROWS + len(short)
    assert plan.runs == [(3, r0, r0 + MIN_RUN_ROWS), (1, r1, len(row_slots))]
    assert [slot for slot, _ in plan.groups] == [0, 1, 2]
    assert plan.groups[0][1].tolist() == [2, *range(r0 + MIN_RUN_ROWS, r1)]
    got = lora_add(base.clone(), x, a, b, scalings, plan)
    torch.testing.assert_close(got, lora_add_reference(base, x, a, b, scalings, row_slots),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(got[row_slots < 0], base[row_slots < 0])
    whole = LoraRows.of(torch.full((MIN_RUN_ROWS,), 2))
    assert whole.runs == [(2, 0, MIN_RUN_ROWS)] and whole.groups == []
    # riders grouped by slot (as the scheduler orders them): each slot's one run is a view
    grouped = torch.tensor([-1, 0, 0, 2, 1, 1, 1, -1])
    plan = LoraRows.of(grouped)
    assert plan.runs == [(0, 1, 3), (2, 3, 4), (1, 4, 7)] and plan.groups == []
    torch.testing.assert_close(lora_add(base[:8].clone(), x[:8], a, b, scalings, plan),
                               lora_add_reference(base[:8], x[:8], a, b, scalings, grouped),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
def test_a_long_run_expands_a_fused_target_by_parts(base_dtype):
    """A run of at least MIN_PART_ROWS rows on a fused target (q|k|v: a block-diagonal B, as
    LoraSlots stacks it) expands part by part on B's diagonal blocks and equals the
    reference; a shorter run and the riders take the whole-B GEMMs; the result is the same
    with and without ``parts`` (the zero blocks add nothing)."""
    gen = torch.Generator().manual_seed(3)
    slots, rank, d_in, parts = 3, 4, 40, (24, 8, 8)
    a = torch.randn(slots, len(parts) * rank, d_in, generator=gen)
    b = torch.stack([torch.block_diag(*(torch.randn(w, rank, generator=gen) for w in parts))
                     for _ in range(slots)])
    scalings = torch.tensor([0.5, 2.0, 1.25])
    row_slots = torch.tensor([0, -1, 2] + [1] * MIN_PART_ROWS + [2] * MIN_RUN_ROWS + [0, -1])
    x = torch.randn(len(row_slots), d_in, generator=gen)
    base = torch.randn(len(row_slots), sum(parts), generator=gen).to(base_dtype)
    plan = LoraRows.of(row_slots)
    assert (1, 3, 3 + MIN_PART_ROWS) in plan.runs
    got = lora_add(base.clone(), x, a, b, scalings, plan, parts)
    tol = 1e-5 if base_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, lora_add_reference(base, x, a, b, scalings, row_slots),
                               rtol=tol, atol=tol)
    torch.testing.assert_close(got, lora_add(base.clone(), x, a, b, scalings, plan),
                               rtol=tol, atol=tol)
    assert torch.equal(got[row_slots < 0], base[row_slots < 0])


@pytest.mark.parametrize("row_slots,d_in,runs", [
    ([-1, 0, 0, 3, -1, 1, 3, 3, 0], 40, False),  # ragged: slot 2 unused, rows of none between
    ([-1, 0, 0, 3, -1, 1, 3, 3, 0], 42, False),  # rows not 16-byte aligned
    ([3, -1, 0, 3, 3], 40, False),  # slots in use not the first ones: weights gathered
    ([1, 0, -1, 0], 40, False),  # the first slots: weight views
    ([2, 2, 2], 40, True),  # one slot, not the first
    ([1], 40, True),  # one row
    ([-1, -1, -1, -1], 40, False),  # no row with an adapter
    ([-1, 1, 1, 2, 2, 3, 3, -1], 40, True),  # runs of one length, adjacent slots: views
    ([-1, 1, 1, 2, 2, 3, 3, -1], 42, True),  # the same, unaligned
    ([4, 4, 0, 0, 2, 2], 40, True),  # runs of one length, slots not adjacent: gathered
    ([1, 1, 1, 0, 2, 2, -1], 40, True),  # runs of several lengths: one GEMM pair each
    ([0, 0, -1, 1, 1], 40, True),  # runs of one length, not end to end
], ids=["ragged", "unaligned", "gathered-slots", "first-slots", "one-slot", "one-row", "none",
        "uniform-runs", "uniform-runs-unaligned", "uniform-runs-gathered", "uneven-runs",
        "runs-apart"])
def test_the_segmented_lora_update_equals_its_reference(row_slots, d_in, runs):
    gen = torch.Generator().manual_seed(1)
    slots, rank, d_out = 5, 8, 24
    a = torch.randn(slots, rank, d_in, generator=gen)
    b = torch.randn(slots, d_out, rank, generator=gen)
    scalings = torch.tensor([0.5, 2.0, 1.25, 0.75, 3.0])
    row_slots = torch.tensor(row_slots)
    x = torch.randn(len(row_slots), d_in, generator=gen)
    base = torch.randn(len(row_slots), d_out, generator=gen)
    segments = LoraSegments.of(row_slots, scalings, torch.float32)
    assert bool(segments.runs.numel()) == runs  # the form the plan took
    want = lora_add_reference(base, x, a, b, scalings, row_slots)
    for plan in (segments, LoraSegments.of(row_slots, scalings, torch.float32, runs=False)):
        got = lora_add_segments(base, x, a, b, plan)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[row_slots < 0], base[row_slots < 0])  # no adapter: untouched


def test_compiled_decode_runs_adapter_batches_with_the_eager_tokens(
        tiny_llama_dir, lora_adapters, lora_eng, references):
    """enable_torch_compile with the C++ kernels: two more graphs (batch 1 and 2..max with
    adapters) compiled at start-up serve every decode batch with adapters, whatever their
    count, with the eager engine's tokens and logprobs bit for bit (so HF's merged tokens)."""
    from torch._dynamo.utils import counters
    prompts, refs = references
    mixed = [None, "alpha", "beta", "alpha", None, "beta", "beta", None]
    workloads = [(prompts + prompts[1:3], mixed),  # two adapters and none, 8 rows
                 ([prompts[0], prompts[3]], ["alpha", "alpha"]),  # one adapter
                 ([prompts[4]], ["beta"])]  # one row
    params = dict(GREEDY, return_logprob=True)

    def run(engine):
        return [engine.generate(input_ids=p, sampling_params=params, lora_path=names)
                for p, names in workloads]

    paths = [f"{name}={path}" for name, path in lora_adapters.items()]
    graphs = counters["stats"]["unique_graphs"]
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=8192,
                enable_torch_compile=True, lora_paths=paths) as eng:
        compiled = eng.runner.compiled_decode
        assert counters["stats"]["unique_graphs"] - graphs == 4  # with and without adapters
        graphs, steps = counters["stats"]["unique_graphs"], compiled.steps
        got = run(eng)
        assert counters["stats"]["unique_graphs"] == graphs  # nothing traced again
        assert compiled.steps - steps >= 3 * (NEW_TOKENS - 1)  # every decode step compiled
    lora_eng.flush_cache()  # prefills reuse cached prefixes alike in both engines
    want = run(lora_eng)
    for g, w in zip(got, want):
        assert [o["output_ids"] for o in g] == [o["output_ids"] for o in w]
        assert [o["output_token_logprobs"] for o in g] == \
            [o["output_token_logprobs"] for o in w]  # the same floats
    for i, (out, name) in enumerate(zip(got[0], mixed)):
        p = i if i < 6 else i - 5
        assert_greedy_equal(out["output_ids"], *refs[(name, p)], f"compiled: {name} prompt {p}")


def test_an_unknown_adapter_is_refused_by_name(lora_eng, eng):
    with pytest.raises(ValueError, match="unknown LoRA adapter 'gamma'"):
        lora_eng.generate(input_ids=[1, 2, 3], lora_path="gamma")
    with pytest.raises(ValueError, match="lora_path has 1 entries for 2 prompts"):
        lora_eng.generate(input_ids=[[1, 2], [3, 4]], lora_path=["alpha"])
    with pytest.raises(ValueError, match="serves no adapters"):
        eng.generate(input_ids=[1, 2, 3], lora_path="alpha")


def test_adapters_load_and_unload_through_the_verbs(tiny_llama_dir, lora_adapters, references):
    prompts, refs = references
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096,
                enable_lora=True, max_lora_rank=4) as eng:
        assert eng.lora_adapters() == {}
        out = eng.load_lora_adapter("alpha", lora_adapters["alpha"])
        assert out["rank"] == 4 and out["loaded_adapters"] == {"alpha": lora_adapters["alpha"]}
        with pytest.raises(ValueError, match="rank 8, above max_lora_rank=4"):
            eng.load_lora_adapter("beta", lora_adapters["beta"])
        with pytest.raises(ValueError, match="already loaded"):
            eng.load_lora_adapter("alpha", lora_adapters["alpha"])
        with pytest.raises(ValueError, match="adapter_config.json"):
            eng.load_lora_adapter("nowhere", os.path.join(lora_adapters["alpha"], "missing"))
        got = eng.generate(input_ids=prompts[0], sampling_params=GREEDY, lora_path="alpha")
        assert_greedy_equal(got["output_ids"], *refs[("alpha", 0)], "loaded alpha")
        # what the worker tells the router it holds: the adapters in its slots
        assert eng.snapshot().adapters_held == ["alpha"]
        assert eng.unload_lora_adapter("alpha") == {"lora_name": "alpha", "loaded_adapters": {}}
        assert eng.snapshot().adapters_held == []
        with pytest.raises(ValueError, match="unknown LoRA adapter 'alpha'"):
            eng.generate(input_ids=prompts[0], lora_path="alpha")
        with pytest.raises(ValueError, match="unknown LoRA adapter 'alpha'"):
            eng.unload_lora_adapter("alpha")
        # reloaded: a new namespace, so the KV of the first load is not reused
        eng.load_lora_adapter("alpha", lora_adapters["alpha"])
        again = eng.generate(input_ids=prompts[0], sampling_params=GREEDY, lora_path="alpha")
        assert again["output_ids"] == got["output_ids"]
        assert again["meta_info"]["cached_tokens"] == 0


def test_the_radix_cache_never_shares_kv_across_adapters(lora_eng):
    prompt = list(range(5, 45))
    one = {"temperature": 0.0, "max_new_tokens": 2}
    lora_eng.flush_cache()

    def cached(name):
        out = lora_eng.generate(input_ids=prompt, sampling_params=one, lora_path=name)
        return out["meta_info"]["cached_tokens"]

    assert cached(None) == 0
    assert cached("alpha") == 0  # the base model's KV of the same prompt is not reused
    assert cached("beta") == 0
    assert cached("alpha") == len(prompt) - 1  # the same adapter hits
    assert cached(None) == len(prompt) - 1
    assert cached("beta") == len(prompt) - 1


def test_lora_options_are_checked():
    from radixray.engine.config import EngineConfig
    with pytest.raises(ValueError, match="adapter names must be unique"):
        EngineConfig(lora_paths=("a=/x", "a=/y"))
    with pytest.raises(ValueError, match="tp_size"):
        EngineConfig(lora_paths=("a=/x",), tp_size=2)
    with pytest.raises(ValueError, match="no ':'"):
        EngineConfig(lora_paths=("base:a=/x",))
    assert EngineConfig(lora_paths=["a=/x"]).lora_paths == ("a=/x",)


def _both_adapters(tiny_llama_dir, lora_adapters) -> Engine:
    """An fp32 engine serving alpha and beta (its own: the tests update them)."""
    return Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096,
                  check_kv_conservation=True,
                  lora_paths=[f"{name}={path}" for name, path in lora_adapters.items()])


def _each_adapter(eng, prompt) -> list[dict]:
    """``prompt`` greedy by the base model, alpha and beta, in one batch."""
    return eng.generate(input_ids=[prompt] * 3, sampling_params=GREEDY,
                        lora_path=[None, "alpha", "beta"])


def test_an_adapter_update_changes_only_that_adapters_outputs_version_stamped(
        tiny_llama_dir, lora_adapters, references, tmp_path):
    from model_fixtures import LORA_ADAPTERS, make_lora_adapter
    from safetensors.torch import load_file

    from radixray.engine.weights.version import VersionRefused
    prompts, refs = references
    rank, alpha, rslora, _ = LORA_ADAPTERS["alpha"]
    v2 = make_lora_adapter(tiny_llama_dir, str(tmp_path / "alpha-v2"), rank, alpha, rslora, 99)
    want_v2, gaps_v2 = hf_greedy(merged_hf(tiny_llama_dir, v2), prompts[3], NEW_TOKENS)
    with _both_adapters(tiny_llama_dir, lora_adapters) as eng:
        def run():
            return _each_adapter(eng, prompts[3])
        before = run()
        assert [o["meta_info"].get("lora_version") for o in before] == [None, 0, 0]
        tensors = load_file(os.path.join(v2, "adapter_model.safetensors"))
        out = eng.update_lora_adapter("alpha", named_tensors=tensors, lora_version="step-1")
        assert out.pop("phases").keys() >= {"transfer", "commit"}
        assert out == {"lora_name": "alpha", "lora_version": "step-1", "previous_version": 0,
                       "running_requests": 0}
        after = run()
        assert after[0]["output_ids"] == before[0]["output_ids"]  # the base model: unchanged
        assert after[2]["output_ids"] == before[2]["output_ids"]  # the other adapter too
        assert_greedy_equal(after[1]["output_ids"], want_v2, gaps_v2, "alpha updated")
        assert after[1]["meta_info"]["lora_version"] == "step-1"
        assert after[1]["meta_info"]["cached_tokens"] == 0  # KV of the old weights: never
        assert after[2]["meta_info"]["cached_tokens"] == len(prompts[3]) - 1
        with pytest.raises(VersionRefused, match="greater than 0"):
            eng.update_lora_adapter("alpha", named_tensors=tensors, lora_version=0)
        beta = load_file(os.path.join(lora_adapters["beta"], "adapter_model.safetensors"))
        with pytest.raises(ValueError, match=r"lora_A is \[4, \d+\], the update sends \[8, "):
            eng.update_lora_adapter("alpha", named_tensors=beta)
        with pytest.raises(ValueError, match="unknown LoRA adapter 'gamma'"):
            eng.update_lora_adapter("gamma", named_tensors=tensors)
        # the whole adapter from a folder, the next int version: the first weights again
        back = eng.update_lora_adapter("alpha", lora_path=lora_adapters["alpha"])
        assert back["lora_version"] == 1 and back["previous_version"] == "step-1"
        again = run()
        assert again[1]["output_ids"] == before[1]["output_ids"]
        assert again[1]["meta_info"]["lora_version"] == 1


def test_a_weight_update_session_updates_one_adapter_by_every_transport(
        tiny_llama_dir, lora_adapters, references, tmp_path):
    """``begin_weight_update(lora_name=...)``: PEFT-named tensors of beta's new weights
    arrive in three parts (tensors, a .safetensors file, a trainer's gloo broadcast) while
    the old beta serves; the end serves them under beta's own version. The base model and
    alpha answer as before, beta as HF with the new adapter merged; the base weight version
    does not move. A bad tensor ends the session with the old adapter serving; a rollback
    serves the old adapter again."""
    from model_fixtures import LORA_ADAPTERS, make_lora_adapter
    from safetensors.torch import load_file, save_file
    from weight_helpers import spawn_trainer

    from radixray.engine.weights.sync import WeightBroadcaster
    prompts, refs = references
    rank, alpha, rslora, _ = LORA_ADAPTERS["beta"]
    v2 = make_lora_adapter(tiny_llama_dir, str(tmp_path / "beta-v2"), rank, alpha, rslora, 77)
    want, gaps = hf_greedy(merged_hf(tiny_llama_dir, v2), prompts[4], NEW_TOKENS)
    new = load_file(os.path.join(v2, "adapter_model.safetensors"))
    names = sorted(new)
    parts = [{n: new[n] for n in names[i::3]} for i in range(3)]
    save_file(parts[1], str(tmp_path / "delta.safetensors"))
    trainer, port = spawn_trainer(dict(sorted(parts[2].items())), tmp_path)
    try:
        with _both_adapters(tiny_llama_dir, lora_adapters) as eng:
            def run():
                return _each_adapter(eng, prompts[4])
            before = run()
            assert_greedy_equal(before[2]["output_ids"], *refs[("beta", 4)], "beta")
            eng.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="g")
            eng.begin_weight_update(lora_name="beta")
            assert eng.update_weights_from_tensor(parts[0])["tensors"] == len(parts[0])
            eng.update_weights_from_disk(str(tmp_path / "delta.safetensors"))
            eng.update_weights_from_distributed(*WeightBroadcaster.spec(sorted(parts[2].items())),
                                                group_name="g")
            _, err = trainer.communicate(timeout=120)
            assert trainer.returncode == 0, err
            assert [o["output_ids"] for o in run()] == [o["output_ids"] for o in before]
            out = eng.end_weight_update("rl-1")
            assert (out["lora_name"], out["lora_version"], out["previous_version"]) == (
                "beta", "rl-1", 0)
            after = run()
            assert after[0]["output_ids"] == before[0]["output_ids"]
            assert after[1]["output_ids"] == before[1]["output_ids"]
            assert_greedy_equal(after[2]["output_ids"], want, gaps, "beta updated by a session")
            assert [o["meta_info"].get("lora_version") for o in after] == [None, 0, "rl-1"]
            assert {o["meta_info"]["weight_version"] for o in after} == {0}
            assert eng.get_weight_version() == 0
            assert after[2]["meta_info"]["cached_tokens"] == 0  # beta's old KV: retired
            assert after[1]["meta_info"]["cached_tokens"] == len(prompts[4]) - 1

            alpha_new = load_file(os.path.join(lora_adapters["alpha"],
                                               "adapter_model.safetensors"))
            eng.begin_weight_update(lora_name="beta")  # rank 4 tensors for a rank 8 adapter
            with pytest.raises(ValueError, match=r"the update sends \[4, \d+\] \(tensor '.*"
                               r"layers\.\d+\.\w+\.\w+_proj\.lora_A\.weight'\)"):
                eng.update_weights_from_tensor(alpha_new)
            eng.begin_weight_update(lora_name="beta")  # the failed session ended
            with pytest.raises(ValueError, match="'model.layers.0.self_attn.q_proj.weight' is "
                               "not a LoRA weight"):
                eng.update_weights_from_tensor({"model.layers.0.self_attn.q_proj.weight":
                                                torch.zeros(64, 64)})
            with pytest.raises(ValueError, match="unknown LoRA adapter 'gamma'"):
                eng.begin_weight_update(lora_name="gamma")
            assert [o["output_ids"] for o in run()] == [o["output_ids"] for o in after]

            # committed, then rolled back (a fleet update that failed elsewhere)
            eng.begin_weight_update(lora_name="beta")
            eng.update_weights_from_disk(lora_adapters["beta"])
            eng.prepare_weight_update(7)
            assert eng.commit_weight_update() == 7
            assert run()[2]["output_ids"] == before[2]["output_ids"]
            assert eng.rollback_weight_update() is True
            again = run()
            assert again[2]["output_ids"] == after[2]["output_ids"]
            assert again[2]["meta_info"]["lora_version"] == "rl-1"
    finally:
        trainer.kill()


def test_adapters_run_on_int8_weights_too(tiny_llama_dir, lora_adapters, lora_eng):
    """w8a8_int8 base layers with the adapters' update in the model's dtype: each adapter
    still changes the output, and the tokens stay close to the fp32 engine's."""
    prompts = random_prompts(256)[:4]
    loras = [None, "alpha", "beta", "alpha"]
    paths = [f"{name}={path}" for name, path in lora_adapters.items()]
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=2048, exact=False,
                quantization="w8a8_int8", lora_paths=paths) as eng:
        mixed = eng.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=loras)
        base = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    fp32 = lora_eng.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=loras)
    assert mixed[0]["output_ids"] == base[0]["output_ids"]
    assert all(mixed[i]["output_ids"] != base[i]["output_ids"] for i in (1, 2, 3))
    same = sum(a == b for m, f in zip(mixed, fp32)
               for a, b in zip(m["output_ids"], f["output_ids"]))
    assert same >= len(prompts) * NEW_TOKENS // 2, same
