"""``radixray bench lora`` end to end on the tiny random Llama: the base row and the LoRA
engine's 0, 1 and 4-adapter rows, the generated adapters as the engine's PEFT reader loads
them, and the JSON it writes."""

from __future__ import annotations

import json

import pytest
import torch

from radixray import Engine
from radixray.bench.lora import write_random_adapters
from radixray.cli import main
from radixray.engine.weights.peft_adapter import LORA_MODULES, read_peft_adapter


def test_the_generated_adapters_load_and_change_the_output(tiny_llama_dir, tmp_path):
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=2048,
                enable_lora=True, max_lora_rank=8) as eng:
        module = eng.model_facts().module
        layers, hidden = len(module.layers), module.config.hidden_size
        paths = write_random_adapters(module, str(tmp_path), count=2, rank=8, seed=0)
        assert sorted(paths) == ["adapter_0", "adapter_1"]
        for name, path in paths.items():
            adapter = read_peft_adapter(name, path, layers)
            assert adapter.rank == 8 and adapter.modules == sorted(LORA_MODULES)
            assert len(adapter.weights) == layers * len(LORA_MODULES)
            a, b = adapter.weights[(0, "q_proj")]
            assert a.shape == (8, hidden) and b.shape[1] == 8 and adapter.scalings[(0, "q_proj")] == 1.0
            eng.load_lora_adapter(name, path)
        # different seeds per adapter; each one moves the greedy tokens off the base's
        a0, a1 = (read_peft_adapter(n, p, layers).weights[(0, "q_proj")][0] for n, p in paths.items())
        assert not torch.equal(a0, a1)
        greedy = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
        prompt = list(range(10, 40))
        outs = eng.generate(input_ids=[prompt] * 3, sampling_params=greedy,
                            lora_path=[None, "adapter_0", "adapter_1"])
        tokens = [o["output_ids"] for o in outs]
        assert tokens[1] != tokens[0] or tokens[2] != tokens[0]


def test_bench_lora_end_to_end(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "lora.json"
    assert main(["bench", "lora", "--model", tiny_llama_dir, "--dtype", "float32",
                 "--concurrency", "4", "--input-len", "16", "--output-len", "6",
                 "--lora-rank", "4", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [(row["config"], row["lora_engine"], row["adapters_in_batch"]) for row in r["rows"]] \
        == [("base", False, 0), ("lora_0", True, 0), ("lora_1", True, 1), ("lora_4", True, 4)]
    for row in r["rows"]:
        assert row["output_tokens"] == 4 * 6  # exactly --output-len per request
        assert row["output_tokens_per_s"] > 0 and row["median_tpot_ms"] > 0
        assert len(row["runs"]) == 1 and row["runs"][0]["decode_steps"] >= 5
    assert r["rows"][0]["ratio_to_base"] == 1.0
    cost = r["adapter_cost"]
    assert cost["adapters_in_batch"] == 4 and cost["target_max"] == 0.25
    assert abs(cost["cost"] - (1 - r["rows"][3]["ratio_to_base"])) < 1e-12
    assert cost["meets_target"] == (cost["cost"] < 0.25)
    assert (r["concurrency"], r["num_prompts"], r["lora_rank"], r["num_adapters"]) == (4, 4, 4, 4)
    assert r["engine_options"]["max_running_requests"] == 4
    printed = capsys.readouterr().out
    assert "lora_4" in printed and "adapters cost" in printed


def test_bench_lora_rounds_pair_each_cost_with_its_own_base(tiny_llama_dir, tmp_path, capsys):
    """``--rounds 2``: both engines started twice, every row holds both rounds' runs, and the
    cost is the median of the two rounds' costs, each against that round's base."""
    import statistics
    out = tmp_path / "lora.json"
    assert main(["bench", "lora", "--model", tiny_llama_dir, "--dtype", "float32",
                 "--concurrency", "2", "--input-len", "8", "--output-len", "4",
                 "--lora-rank", "4", "--num-adapters", "2", "--adapters-in-batch", "2",
                 "--rounds", "2", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["rounds"] == 2 and [len(row["runs"]) for row in r["rows"]] == [2, 2]
    base, lora = ([run["output_tokens_per_s"] for run in row["runs"]] for row in r["rows"])
    costs = [1 - lora[k] / base[k] for k in range(2)]
    cost = r["adapter_cost"]
    assert cost["round_costs"] == pytest.approx(costs)
    assert cost["cost"] == pytest.approx(statistics.median(costs))
    assert "median of the rounds" in capsys.readouterr().out


def _forms_script():
    import importlib.util
    import pathlib
    script = pathlib.Path(__file__).parents[2] / "bench" / "lora_forms.py"
    spec = importlib.util.spec_from_file_location("lora_forms", script)
    forms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(forms)
    return forms


def test_the_decode_forms_script_gives_both_forms_the_same_tokens(tiny_llama_dir, tmp_path):
    """bench/lora_forms.py on the tiny Llama: one round of each form of the decode op, the
    same tokens, the JSON written, and the plan's classmethod put back."""
    from radixray.kernels.lora import LoraSegments
    forms = _forms_script()
    original = LoraSegments.__dict__["of"]
    out_json = tmp_path / "forms.json"
    out = forms.main(["--num-prompts", "4", "--input-len", "8", "--output-len", "6",
                      "--num-adapters", "2", "--lora-rank", "4", "--rounds", "1",
                      "--engine-json", json.dumps({"model": tiny_llama_dir, "dtype": "float32"}),
                      "--output-json", str(out_json)])
    assert out["same_tokens"] and json.loads(out_json.read_text())["rounds"] == 1
    assert out["runs"]["median_tpot_ms"] > 0 and out["groups"]["median_tpot_ms"] > 0
    assert LoraSegments.__dict__["of"] is original


def test_the_expand_parts_comparison_gives_both_forms_the_same_tokens(tiny_llama_dir,
                                                                     monkeypatch):
    """``--compare expand-parts`` with prompts long enough for the parts (MIN_PART_ROWS):
    the parts' path ran, the same first tokens by parts and by the whole B, compared by
    batch seconds (one token each), and the threshold put back."""
    from radixray.kernels import lora as lora_kernels
    forms = _forms_script()
    threshold = lora_kernels.MIN_PART_ROWS
    calls = []
    by_part = lora_kernels._expand_by_part
    monkeypatch.setattr(lora_kernels, "_expand_by_part",
                        lambda *args: calls.append(args[-1]) or by_part(*args))
    out = forms.main(["--compare", "expand-parts", "--num-prompts", "2",
                      "--input-len", str(threshold), "--output-len", "1",
                      "--num-adapters", "2", "--lora-rank", "4", "--rounds", "1",
                      "--engine-json", json.dumps({"model": tiny_llama_dir, "dtype": "float32"})])
    assert out["same_tokens"] and out["compared_by"] == "seconds"
    assert out["parts"]["median_seconds"] > 0 and out["whole"]["median_tpot_ms"] is None
    assert lora_kernels.MIN_PART_ROWS == threshold
    assert len(set(calls)) == 2, calls[:4]  # q|k|v and gate|up, by parts


def test_the_int8_shrink_comparison_runs_both_forms_in_an_int8_engine(tiny_llama_dir,
                                                                     monkeypatch):
    """``--compare int8-shrink`` on a w8a8 int8 engine: the int8 shrinks ran in the int8
    form's rounds only, both forms timed; an fp32 engine is refused by name."""
    from radixray.kernels.lora import MIN_INT8_ROWS, Int8Shrink
    forms = _forms_script()
    calls = []
    shrink = Int8Shrink.shrink
    monkeypatch.setattr(Int8Shrink, "shrink",
                        lambda self, *span: calls.append(span) or shrink(self, *span))
    out = forms.main(["--compare", "int8-shrink", "--num-prompts", "2",
                      "--input-len", str(MIN_INT8_ROWS), "--output-len", "1",
                      "--num-adapters", "2", "--lora-rank", "4", "--rounds", "1",
                      "--engine-json", json.dumps({"model": tiny_llama_dir, "dtype": "float32",
                                                   "quantization": "w8a8_int8"})])
    assert out["compared_by"] == "seconds" and calls
    assert out["int8"]["median_seconds"] > 0 and out["fp32"]["median_seconds"] > 0
    with pytest.raises(SystemExit, match="int8 engine"):
        forms.main(["--compare", "int8-shrink", "--num-prompts", "2", "--input-len", "4",
                    "--output-len", "1", "--num-adapters", "1", "--lora-rank", "4",
                    "--rounds", "1", "--engine-json",
                    json.dumps({"model": tiny_llama_dir, "dtype": "float32"})])
