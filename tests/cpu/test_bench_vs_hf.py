"""``radixray bench vs-hf`` end to end at tiny sizes, with --random-weights."""

from __future__ import annotations

import json
import os

from radixray.bench.vs_hf import random_weight_copy
from radixray.cli import main


def test_random_weight_copy_keeps_config_and_tokenizer(tiny_llama_dir, tmp_path):
    out = random_weight_copy(tiny_llama_dir, str(tmp_path / "copy"), seed=3)
    with open(os.path.join(tiny_llama_dir, "config.json")) as a, open(os.path.join(out, "config.json")) as b:
        assert json.load(a)["num_hidden_layers"] == json.load(b)["num_hidden_layers"]
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    assert os.path.exists(os.path.join(out, "model.safetensors"))


def test_vs_hf_end_to_end(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "vs_hf.json"
    assert main(["bench", "vs-hf", "--model", tiny_llama_dir, "--random-weights", "--dtype", "float32",
                 "--input-len", "12", "--output-len", "6", "--num-prompts", "4",
                 "--concurrency", "1,4", "--hf-prompts", "2", "--output", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["random_weights"] and r["device"] == "cpu"
    assert r["hf"]["output_tokens"] == 2 * 6  # exactly --output-len per prompt
    assert [e["concurrency"] for e in r["radixray"]] == [1, 4]
    for e in r["radixray"]:
        assert e["output_tokens"] == 4 * 6 and e["x_hf"] > 0
    assert "x HF" in capsys.readouterr().out
