"""String weight versions as SGLang's RL clients send them ("v1", a step tag) and refused
versions on the in-process engine: the label stamps outputs, a refused version keeps the
session and its staged weights for a retry, integers keep their order across labels, one
label on two buckets never shares KV between them; the HTTP body's shape and the version's
metrics. The fleet's rules are in test_weight_rollout.py, the HTTP round trip in
test_fleet.py."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import random_prompts
from weight_helpers import GREEDY_N, assert_matches_hf, perturb

from radixray import Engine
from radixray.engine.weights.version import VersionRefused

NEW = 12


def _hf(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _engine(model_dir):
    return Engine(model=model_dir, dtype="float32", max_total_tokens=4096,
                  check_kv_conservation=True)


def _outputs(eng, prompts) -> list[list[int]]:
    return [o["output_ids"] for o in eng.generate(
        input_ids=prompts, sampling_params={**GREEDY_N, "max_new_tokens": NEW})]


def test_a_string_version_stamps_outputs_and_a_refused_one_keeps_the_staged_weights(
        tiny_llama_dir):
    """end_weight_update("v1") serves the weights as "v1" (get_weight_version, meta_info,
    the snapshot); before it, a refused version changed nothing and left the session open,
    and the retry committed the very tensors staged before the refusal."""
    hf = _hf(tiny_llama_dir)
    prompts = random_prompts(hf.config.vocab_size)[2:4]
    with _engine(tiny_llama_dir) as eng:
        before = _outputs(eng, prompts)
        eng.begin_weight_update()
        eng.update_weights_from_tensor(perturb(hf, seed=41))
        for refused in (0, -3, True, 2.5, ""):
            with pytest.raises(VersionRefused, match="weight_version"):
                eng.end_weight_update(refused)
        assert eng.get_weight_version() == 0 and _outputs(eng, prompts) == before
        with pytest.raises(ValueError, match="already open"):
            eng.begin_weight_update()  # the session is still there
        result = eng.end_weight_update("v1")
        assert result["weight_version"] == "v1" and result["previous_version"] == 0
        assert eng.get_weight_version() == "v1" and eng.snapshot().weight_version == "v1"
        after = assert_matches_hf(eng, hf, prompts, NEW, "staged before the refusal",
                                  version="v1")
        assert [o["output_ids"] for o in after] != before
        assert eng.abort_weight_update() is False  # the retry closed the session
        eng.check_kv_conservation()


def test_ints_keep_their_order_across_labels_and_a_rollback_restores_it(tiny_llama_dir):
    """An int must exceed every int served before, labels in between too; a label may
    repeat; no version means the next int; a rolled-back commit does not raise the bound."""
    with _engine(tiny_llama_dir) as eng:
        delta = {"model.norm.weight": torch.ones(64)}  # a one-tensor update

        def update(version):
            eng.begin_weight_update()
            eng.update_weights_from_tensor(delta)
            return eng.end_weight_update(version)["weight_version"]

        assert [update(3), update("v1"), update("v1")] == [3, "v1", "v1"]
        eng.begin_weight_update()
        eng.update_weights_from_tensor(delta)
        for refused in (3, 2):
            with pytest.raises(VersionRefused, match="greater than 3"):
                eng.end_weight_update(refused)
        assert eng.end_weight_update(4)["weight_version"] == 4
        assert update("3") == "3"  # a string, not the int 3: a label with no order
        assert eng.get_weight_version() == "3"
        eng.begin_weight_update()
        eng.update_weights_from_tensor(delta)
        assert eng.prepare_weight_update(10)["weight_version"] == 10
        assert eng.commit_weight_update() == 10 and eng.get_weight_version() == 10
        assert eng.rollback_weight_update() is True
        assert eng.get_weight_version() == "3"
        assert update(5) == 5  # the bound is 4 again, not the rolled-back 10
        assert update(None) == 6
        eng.check_kv_conservation()


def test_one_label_on_two_buckets_never_reuses_kv_of_the_first(tiny_llama_dir):
    """SGLang's clients name the same version on every bucket of an update; each bucket is
    one update here, so a prompt cached after the first bucket must be computed again
    after the second (the cache keys on a generation, not the label)."""
    hf = _hf(tiny_llama_dir)
    prompt = random_prompts(hf.config.vocab_size)[6]
    params = {**GREEDY_N, "max_new_tokens": NEW}
    with _engine(tiny_llama_dir) as eng:
        named = perturb(hf, seed=43)
        names = sorted(named)
        eng.begin_weight_update()
        eng.update_weights_from_tensor({n: named[n] for n in names[::2]})
        eng.end_weight_update("step-1")
        eng.generate(input_ids=prompt, sampling_params=params)
        assert eng.generate(input_ids=prompt, sampling_params=params)["meta_info"][
            "cached_tokens"] > 0
        eng.begin_weight_update()
        eng.update_weights_from_tensor({n: named[n] for n in names[1::2]})
        eng.end_weight_update("step-1")
        out = eng.generate(input_ids=prompt, sampling_params=params)
        assert out["meta_info"]["cached_tokens"] == 0
        assert out["meta_info"]["weight_version"] == "step-1"
        assert_matches_hf(eng, hf, [prompt], NEW, "both buckets", version="step-1")
        eng.check_kv_conservation()


def test_update_weight_version_renames_the_weights_and_keeps_their_kv(tiny_llama_dir):
    """SGLang's update_weight_version: a new name for the weights serving now; their cached
    prefixes stay valid, the int order holds, a refusal changes nothing."""
    hf = _hf(tiny_llama_dir)
    prompt = random_prompts(hf.config.vocab_size)[4]
    params = {**GREEDY_N, "max_new_tokens": NEW}
    with _engine(tiny_llama_dir) as eng:
        eng.begin_weight_update()
        eng.update_weights_from_tensor(perturb(hf, seed=44))
        eng.end_weight_update(3)
        first = eng.generate(input_ids=prompt, sampling_params=params)
        assert eng.update_weight_version("rollout-7") == {"weight_version": "rollout-7",
                                                           "previous_version": 3}
        with pytest.raises(VersionRefused, match="greater than 3"):
            eng.update_weight_version(3)
        again = eng.generate(input_ids=prompt, sampling_params=params)
        assert again["meta_info"]["weight_version"] == "rollout-7"
        assert again["meta_info"]["cached_tokens"] > 0  # the same weights: KV reused
        assert again["output_ids"] == first["output_ids"]
        assert eng.update_weight_version(5)["weight_version"] == 5
        eng.begin_weight_update()
        eng.update_weights_from_tensor({"model.norm.weight": torch.ones(64)})
        with pytest.raises(VersionRefused, match="greater than 5"):
            eng.end_weight_update(4)
        assert eng.prepare_weight_update(None)["weight_version"] == 6
        with pytest.raises(ValueError, match="between prepare and finish"):
            eng.update_weight_version(9)  # 6 was checked against the names before
        assert eng.commit_weight_update() == 6
        assert eng.finish_weight_update()["weight_version"] == 6
        eng.check_kv_conservation()


def test_a_rename_renames_the_current_span_of_live_requests():
    from types import SimpleNamespace

    from radixray.engine.weights.session import rename_last_span
    req = SimpleNamespace(weight_spans=[[0, 0], [3, 5]])
    rename_last_span(req, "v3")
    assert req.weight_spans == [[0, 0], ["v3", 5]]
    rename_last_span(req, 0)  # the name of the weights before, but other weights
    assert req.weight_spans == [[0, 0], [0, 5]]
    waiting = SimpleNamespace(weight_spans=[])
    rename_last_span(waiting, "v4")
    assert waiting.weight_spans == []


def test_the_http_body_takes_an_int_or_a_label_and_names_weight_version_otherwise():
    import pydantic

    from radixray.serve.protocol import UpdateWeightsFromDisk, UpdateWeightVersion
    for version in (1, 7, "v1", "3", None):
        assert UpdateWeightsFromDisk(model_path="/m", weight_version=version).weight_version \
            == version
    parsed = UpdateWeightsFromDisk.model_validate_json('{"model_path": "/m", '
                                                      '"weight_version": "12"}')
    assert parsed.weight_version == "12"  # a JSON string stays a label
    for bad in (0, -1, True, 1.5, "", "x" * 257, [1]):
        with pytest.raises(pydantic.ValidationError) as err:
            UpdateWeightsFromDisk(model_path="/m", weight_version=bad)
        assert [e["loc"] for e in err.value.errors()] == [("weight_version",)]
        with pytest.raises(pydantic.ValidationError) as err:
            UpdateWeightVersion(new_version=bad)
        assert [e["loc"] for e in err.value.errors()] == [("new_version",)]
    assert UpdateWeightVersion(new_version="v2").new_version == "v2"
    with pytest.raises(pydantic.ValidationError, match="abort_all_requests is not supported"):
        UpdateWeightVersion(new_version="v2", abort_all_requests=True)


def test_a_string_version_is_an_info_label_and_an_int_also_a_gauge():
    from radixray.cluster.metrics import weight_version_families

    def series(version):
        return {(f.name, tuple(sorted(s.labels.items())), s.value)
                for f in weight_version_families(["worker-0"], version) for s in f.samples}
    info = "radixray:weight_version_info"
    assert series("v1") == {(info, (("weight_version", "v1"), ("worker", "worker-0")), 1.0)}
    assert series(3) == {(info, (("weight_version", "3"), ("worker", "worker-0")), 1.0),
                         ("radixray:weight_version", (("worker", "worker-0"),), 3.0)}
