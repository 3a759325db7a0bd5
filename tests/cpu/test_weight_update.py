"""Weight-update sessions on the in-process engine: each source, versions, spans, the prefix
cache, partial updates, int8 repacking, and every refusal leaving the old weights serving."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import in_thread, wait_until
from model_fixtures import random_prompts
from weight_helpers import GREEDY_N, assert_matches_hf, perturb, spawn_trainer

from radixray import Engine
from radixray.engine.weights.version import VersionRefused

NEW = 24


def _hf(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _engine(model_dir, **kw):
    return Engine(model=model_dir, dtype="float32", max_total_tokens=4096,
                  check_kv_conservation=True, **kw)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_tensor_update_of_every_parameter_matches_hf(kind, request):
    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    hf = _hf(model_dir)
    prompts = random_prompts(hf.config.vocab_size)[3:6]
    with _engine(model_dir) as eng:
        before = eng.generate(input_ids=prompts, sampling_params={**GREEDY_N, "max_new_tokens": NEW})
        assert all(o["meta_info"]["weight_version"] == 0 for o in before)
        named = perturb(hf, seed=1)
        eng.begin_weight_update()
        staged = eng.update_weights_from_tensor(list(named.items()))
        assert staged["tensors"] == len(named)
        result = eng.end_weight_update(1)
        assert result["weight_version"] == 1 and result["previous_version"] == 0
        assert set(result["phases"]) == {"transfer", "load", "commit"}
        assert eng.get_weight_version() == 1
        after = assert_matches_hf(eng, hf, prompts, NEW, f"{kind} after update", version=1)
        assert [o["output_ids"] for o in after] != [o["output_ids"] for o in before]
        eng.check_kv_conservation()


def test_disk_update_matches_hf_and_a_partial_update_keeps_the_rest(tiny_llama_dir, tmp_path):
    hf = _hf(tiny_llama_dir)
    prompts = random_prompts(hf.config.vocab_size)[2:5]
    with _engine(tiny_llama_dir) as eng:
        perturb(hf, seed=2)
        hf.save_pretrained(tmp_path / "v1", safe_serialization=True)
        eng.begin_weight_update()
        eng.update_weights_from_disk(str(tmp_path / "v1"))
        eng.end_weight_update(5)
        assert_matches_hf(eng, hf, prompts, NEW, "disk update", version=5)
        # Only two tensors, one of them a shard of the fused qkv: the rest stays as it is.
        with torch.no_grad():
            q = hf.model.layers[1].self_attn.q_proj.weight
            q.mul_(-1.5)
            down = hf.model.layers[0].mlp.down_proj.weight
            down.add_(0.05)
        eng.begin_weight_update()
        eng.update_weights_from_tensor({"model.layers.1.self_attn.q_proj.weight": q,
                                        "model.layers.0.mlp.down_proj.weight": down})
        eng.end_weight_update(6)
        outs = assert_matches_hf(eng, hf, prompts, NEW, "partial update", version=6)
        # A checkpoint folder missing a tensor is truncated, not a delta: refused.
        from safetensors.torch import load_file, save_file
        weights = load_file(str(tmp_path / "v1" / "model.safetensors"))
        del weights["model.layers.2.mlp.up_proj.weight"]
        (tmp_path / "cut").mkdir()
        save_file(weights, str(tmp_path / "cut" / "model.safetensors"))
        eng.begin_weight_update()
        with pytest.raises(ValueError, match=r"missing 1 tensors.*layers.2.mlp.up_proj"):
            eng.update_weights_from_disk(str(tmp_path / "cut"))
        assert eng.get_weight_version() == 6
        _serves_unchanged(eng, prompts, [o["output_ids"] for o in outs], 6)


def test_int8_layers_are_repacked_once_at_the_end(tiny_llama_dir, tmp_path):
    """An int8 engine updated to new weights computes exactly what an int8 engine loaded
    from those weights computes (same codes, same packing)."""
    hf = _hf(tiny_llama_dir)
    named = perturb(hf, seed=3)
    hf.save_pretrained(tmp_path / "new", safe_serialization=True)
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(tmp_path / "new")
    prompts = random_prompts(hf.config.vocab_size)[1:4]
    params = {**GREEDY_N, "max_new_tokens": NEW}
    quant = {"quantization": "w8a8_int8", "quantize_lm_head": True}
    with _engine(str(tmp_path / "new"), **quant) as ref:
        expected = [o["output_ids"] for o in ref.generate(input_ids=prompts, sampling_params=params)]
    with _engine(tiny_llama_dir, **quant) as eng:
        eng.begin_weight_update()
        eng.update_weights_from_tensor(named)
        eng.end_weight_update(1)
        got = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
        assert got == expected
        # A quantized fused layer cannot take one shard alone: its fp32 rows are gone.
        eng.begin_weight_update()
        eng.update_weights_from_tensor({"model.layers.0.self_attn.q_proj.weight":
                                        named["model.layers.0.self_attn.q_proj.weight"]})
        with pytest.raises(ValueError, match=r"int8-quantized.*k_proj"):
            eng.end_weight_update(2)
        assert eng.get_weight_version() == 1
        assert [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)] \
            == expected


def _serves_unchanged(eng, prompts, expected, version):
    params = {**GREEDY_N, "max_new_tokens": NEW}
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == expected
    assert all(o["meta_info"]["weight_version"] == version for o in outs)
    eng.check_kv_conservation()


def test_bad_sessions_are_refused_and_the_old_weights_keep_serving(tiny_llama_dir):
    hf = _hf(tiny_llama_dir)
    named = perturb(hf, seed=4)
    prompts = random_prompts(hf.config.vocab_size)[:2]
    with _engine(tiny_llama_dir) as eng:
        expected = [o["output_ids"] for o in eng.generate(
            input_ids=prompts, sampling_params={**GREEDY_N, "max_new_tokens": NEW})]
        with pytest.raises(ValueError, match="no weight update session is open"):
            eng.update_weights_from_tensor(named)
        with pytest.raises(ValueError, match="no weight update session is open"):
            eng.end_weight_update(1)
        eng.begin_weight_update()
        with pytest.raises(ValueError, match="already open"):
            eng.begin_weight_update()
        with pytest.raises(ValueError, match="no tensors were staged"):
            eng.end_weight_update(1)
        # a failed end drops the session
        with pytest.raises(ValueError, match="no weight update session is open"):
            eng.end_weight_update(1)
        bad = [("model.layers.0.mlp.up_proj.weight", named["model.layers.0.mlp.up_proj.weight"]),
               ("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, 3))]
        eng.begin_weight_update()
        with pytest.raises(ValueError, match=r"k_proj.weight.*shape \(3, 3\).*expects"):
            eng.update_weights_from_tensor(bad)
        with pytest.raises(ValueError, match="no weight update session is open"):
            eng.end_weight_update(1)  # the whole session went with the bad tensor
        eng.begin_weight_update()
        with pytest.raises(ValueError, match="'model.layers.9.mlp.up_proj.weight' has no matching"):
            eng.update_weights_from_tensor({"model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
        eng.begin_weight_update()
        eng.update_weights_from_tensor(named)
        for version, why in ((0, "greater than 0"), (-1, "greater than 0"), (1.5, "float"),
                             (True, "bool"), ("", "1 to 256 characters")):
            with pytest.raises(VersionRefused, match=f"weight_version.*{why}"):
                eng.end_weight_update(version)
        _serves_unchanged(eng, prompts, expected, 0)
        assert eng.abort_weight_update() is True  # a refused version kept the session open
        assert eng.abort_weight_update() is False
        eng.begin_weight_update()
        eng.update_weights_from_tensor(named)
        assert eng.abort_weight_update() is True
        _serves_unchanged(eng, prompts, expected, 0)


def test_a_prefix_cached_before_an_update_is_not_reused_after_it(tiny_llama_dir):
    hf = _hf(tiny_llama_dir)
    prompt = random_prompts(hf.config.vocab_size)[6]
    params = {**GREEDY_N, "max_new_tokens": 4}
    with _engine(tiny_llama_dir) as eng:
        eng.generate(input_ids=prompt, sampling_params=params)
        assert eng.generate(input_ids=prompt, sampling_params=params)["meta_info"]["cached_tokens"] > 0
        eng.begin_weight_update()
        eng.update_weights_from_tensor(perturb(hf, seed=5))
        eng.end_weight_update(1)
        first = eng.generate(input_ids=prompt, sampling_params=params)
        assert first["meta_info"]["cached_tokens"] == 0
        again = eng.generate(input_ids=prompt, sampling_params=params)
        assert again["meta_info"]["cached_tokens"] > 0
        assert again["output_ids"] == first["output_ids"]
        eng.check_kv_conservation()


@pytest.mark.parametrize("mode, version", [("in_place", 7), ("retract", "v7")])
def test_a_request_living_through_an_update_reports_version_spans(tiny_llama_dir, mode, version):
    hf = _hf(tiny_llama_dir)
    named = perturb(hf, seed=6)
    with _engine(tiny_llama_dir) as eng:
        t, box = in_thread(eng.generate, input_ids=[5, 6, 7, 8], sampling_params={
            **GREEDY_N, "max_new_tokens": 400})
        wait_until(eng, lambda s: any(len(r.output_ids) >= 3 for r in s.queues.running))
        eng.pause_generation(mode)
        produced = eng.call_in_loop(lambda s: [len(r.output_ids) for r in s.queues.running + s.queues.waiting])[0]
        eng.begin_weight_update()
        eng.update_weights_from_tensor(named)
        eng.end_weight_update(version)
        eng.continue_generation()
        t.join(120)
        meta = box["out"]["meta_info"]
        assert meta["weight_version"] == version
        assert meta["weight_versions"] == [
            {"weight_version": 0, "start": 0, "end": produced},
            {"weight_version": version, "start": produced, "end": 400}]
        assert (meta["num_retractions"] == 1) == (mode == "retract")
        eng.check_kv_conservation()


def test_distributed_update_from_a_trainer_process_over_gloo(tiny_qwen3_dir, tmp_path):
    from radixray.engine.weights.sync import WeightBroadcaster
    hf = _hf(tiny_qwen3_dir)
    named = dict(sorted(perturb(hf, seed=7).items()))
    trainer, port = spawn_trainer(named, tmp_path)
    try:
        with _engine(tiny_qwen3_dir) as eng:
            eng.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2,
                                          group_name="g", backend="gloo")
            names, dtypes, shapes = WeightBroadcaster.spec(named.items())
            eng.begin_weight_update()
            staged = eng.update_weights_from_distributed(names, dtypes, shapes, group_name="g")
            assert staged["tensors"] == len(names)
            eng.end_weight_update(2)
            out, err = trainer.communicate(timeout=120)
            assert trainer.returncode == 0, err
            assert int(out.strip()) == staged["bytes"]
            prompts = random_prompts(hf.config.vocab_size)[2:5]
            assert_matches_hf(eng, hf, prompts, NEW, "distributed update", version=2)
            # Leaving the group frees its name for the next trainer's group.
            assert eng.destroy_weights_update_group("g") is True
            assert eng.destroy_weights_update_group("g") is False
    finally:
        trainer.kill()


@pytest.mark.slow  # out of the default run's 15-minute budget: make test-slow
def test_default_model_takes_new_weights_by_every_path(tmp_path):
    """SmolLM2-135M: a tensor, a disk and a distributed update, each of every parameter, each
    followed by greedy output equal to transformers' on the same weights. transformers loads
    the Hugging Face folder the GGUF was converted to (test_hf_equality checks that folder
    against transformers' own GGUF loading, which takes 25 s here)."""
    from safetensors.torch import save_file

    from radixray.engine.weights.loader import resolve_model
    from radixray.engine.weights.sync import WeightBroadcaster
    source = resolve_model("default")
    hf = _hf(source.path)
    prompts = [source.tokenizer.encode(p)
               for p in ("The capital of France is", "def fibonacci(n):\n    ")]
    with Engine(model="default", max_total_tokens=4096, check_kv_conservation=True) as eng:
        eng.begin_weight_update()
        eng.update_weights_from_tensor(perturb(hf, seed=11, scale=0.05))
        eng.end_weight_update(1)
        assert_matches_hf(eng, hf, prompts, 12, "smollm2 tensor", version=1)

        disk = perturb(hf, seed=12, scale=0.05)
        save_file({k: v.contiguous() for k, v in disk.items()}, str(tmp_path / "disk.safetensors"))
        eng.begin_weight_update()
        eng.update_weights_from_disk(str(tmp_path / "disk.safetensors"))
        eng.end_weight_update(2)
        assert_matches_hf(eng, hf, prompts, 12, "smollm2 disk", version=2)

        named = dict(sorted(perturb(hf, seed=13, scale=0.05).items()))
        trainer, port = spawn_trainer(named, tmp_path)
        try:
            eng.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="g")
            eng.begin_weight_update()
            eng.update_weights_from_distributed(*WeightBroadcaster.spec(named.items()), group_name="g")
            eng.end_weight_update(3)
            _, err = trainer.communicate(timeout=300)
            assert trainer.returncode == 0, err
        finally:
            trainer.kill()
        assert_matches_hf(eng, hf, prompts, 12, "smollm2 distributed", version=3)
        eng.check_kv_conservation()


def test_shared_weights_file_and_object_store_payload_round_trip(tmp_path):
    from radixray.cluster.shared_weights import SharedWeightsWriter, read_shared
    from radixray.cluster.tensor_payload import from_payload, is_payload, to_payload
    named = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16),
             "c": torch.randn(2, 2, 2).half()}
    writer = SharedWeightsWriter(named, directory=str(tmp_path))
    handle = writer.write(named)
    got = dict(read_shared(handle))
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in named.items())
    named["a"].add_(1.0)
    writer.write({"a": named["a"]})  # rewritten in place; a new read sees it
    assert torch.equal(dict(read_shared(handle))["a"], named["a"])
    with pytest.raises(ValueError, match="'z' is not in this shared weights file"):
        writer.write({"z": torch.zeros(1)})
    writer.close()
    payload = to_payload(named)
    assert is_payload(payload) and not is_payload(list(named.items()))
    back = dict(from_payload(payload))
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in named.items())


def test_a_full_update_replaces_released_weights_without_reading_them_back(tiny_qwen3_dir):
    """The colocated RL step: weights released (spilled) while the trainer trains, then a
    full update commits new tensors into them; only the rotary tables are read back."""
    hf = _hf(tiny_qwen3_dir)
    named = perturb(hf, seed=8)
    prompts = random_prompts(hf.config.vocab_size)[1:3]
    with _engine(tiny_qwen3_dir) as eng:
        eng.pause_generation("retract")
        eng.release_memory_occupation(["kv_cache", "weights"])
        eng.begin_weight_update()
        eng.update_weights_from_tensor({"model.norm.weight": named["model.norm.weight"]})
        with pytest.raises(ValueError, match="released, so an update must replace all of them"):
            eng.end_weight_update(1)
        eng.begin_weight_update()
        eng.update_weights_from_tensor(named)
        eng.end_weight_update(1)
        assert eng.memory.released == {"kv_cache"}
        eng.resume_memory_occupation(["kv_cache"])
        eng.continue_generation()
        assert_matches_hf(eng, hf, prompts, NEW, "released weights replaced", version=1)
        eng.check_kv_conservation()
