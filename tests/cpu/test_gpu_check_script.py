"""The prepared GPU check (scripts/gpu_check.sh) without a GPU: its dry run names every step
and passes its own checks (files, imports, a tiny random model swept on the CPU, the
report); and the random-model helper builds folders radixray loads."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(REPO, "scripts")


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # ~18 s: out of the quick run's 15-minute budget
def test_dry_run_plans_every_step_and_passes(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(["bash", os.path.join(SCRIPTS, "gpu_check.sh"), "--dry-run", "--out",
                           str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    plan = proc.stdout
    for step, command in (
            ("kernel-tests", "tests/cpu/test_triton_attention.py tests/cpu/test_triton_moe.py"),
            ("gpu-tests", "-m gpu tests/gpu"),
            ("random-model", "make_random_model.py --shape llama-1b"),
            ("bench-decode", "gpu_decode_sweep.py run"),
            ("bench-nograph", "--disable-cuda-graph")):
        line = next((ln for ln in plan.splitlines() if ln.strip().startswith(step)), None)
        assert line is not None and command in line, f"{step} not planned:\n{plan}"
    assert "TRITON_INTERPRET=0" in plan and "--batch-sizes 1,2,4,8,16,32,64,128,256" in plan
    assert "FAIL" not in plan
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["dry_run"] is True
    assert {s["name"]: s["status"] for s in report["steps"]} == {
        "kernel-tests": "planned", "gpu-tests": "planned", "random-model": "planned",
        "bench-decode": "planned", "bench-nograph": "planned", "dry-run-checks": "pass"}
    decode = report["bench"]["decode"]
    assert decode["complete"] and [r["batch"] for r in decode["decode"]] == [1, 2]
    assert all(r["step_ms"] > 0 for r in decode["decode"]) and decode["prefill"]["tokens_per_s"] > 0
    assert "=== GPU check (dry run)" in plan  # the table


def test_tiny_random_model_loads_and_generates(tmp_path):
    from radixray import Engine
    folder = tmp_path / "tiny"
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "make_random_model.py"),
                           "--shape", "tiny", "--out", str(folder)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["shape"] == "tiny" and summary["params"] > 0
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    with Engine(model=str(folder), dtype="float32", max_total_tokens=512) as eng:
        out = eng.generate(input_ids=[5, 6, 7, 8], sampling_params={
            "temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True})
        assert len(out["output_ids"]) == 2
        assert all(0 <= t < config["vocab_size"] for t in out["output_ids"])
    again = subprocess.run([sys.executable, os.path.join(SCRIPTS, "make_random_model.py"),
                            "--shape", "tiny", "--out", str(folder), "--reuse"],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and json.loads(again.stdout.strip())["reused"] is True


def test_llama_1b_shape_is_llama_3_2_1b():
    """The benchmark model has Llama-3.2-1B's parameter count (built on the meta device)."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM
    spec = dict(_load_script("make_random_model").SHAPES["llama-1b"])
    spec.pop("dtype")
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**spec))
    assert sum(p.numel() for p in model.parameters()) == 1_235_814_400
    assert model.config.num_key_value_heads == 8 and model.config.tie_word_embeddings


def test_peak_bandwidth_by_device_name():
    sweep = _load_script("gpu_decode_sweep")
    assert sweep.peak_bandwidth("NVIDIA H200") == 4.8e12
    assert sweep.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert sweep.peak_bandwidth("NVIDIA A100-SXM4-80GB") == 2.0e12
    assert sweep.peak_bandwidth("NVIDIA L4") is None
