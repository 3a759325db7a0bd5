"""The fleet-wide update's all-or-none logic and a restarted worker's catch-up, over fake
worker handles (the Ray path is tests/cpu/test_fleet.py); a LoRA adapter's fleet update and
catch-up over real engines behind the handles' call shape."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from radixray.actors.weight_rollout import FleetUpdateFailed, FleetWeights, run_fleet_update
from radixray.cluster.weight_sources import DiskWeights, TensorWeights
from radixray.engine.weights.version import VersionRefused


class FakeWorker:
    """Records every call; ``fail`` names the method that raises once."""

    def __init__(self, name: str, fail: str | None = None):
        self.name, self.fail, self.calls, self.version = name, fail, [], 0
        self.staged = None

    def __getattr__(self, method):
        worker = self

        class _Method:
            @staticmethod
            def remote(*args):
                async def run():
                    worker.calls.append(method)
                    if worker.fail == method:
                        worker.fail = None
                        raise RuntimeError(f"{method} broke on {worker.name}")
                    if method == "prepare_weight_update":
                        worker.staged = args[0]
                    elif method in ("commit_weight_update", "end_weight_update"):
                        worker.version, worker.old = args[0] if args else worker.staged, worker.version
                    elif method == "rollback_weight_update":
                        worker.version = worker.old
                    elif method == "update_weight_version":
                        worker.version = args[0]
                    return method
                return run()
        return _Method


@dataclass
class Rec:
    worker_id: str
    handle: FakeWorker
    weight_version: int | str = 0


DISK = DiskWeights("/ckpt")


def _run(coro):
    return asyncio.run(coro)


def test_a_commit_failing_on_one_worker_rolls_the_others_back_and_continues_everyone():
    a, b = FakeWorker("a"), FakeWorker("b", fail="commit_weight_update")
    phases: dict = {}
    with pytest.raises(FleetUpdateFailed, match="b: commit_weight_update broke on b"):
        _run(run_fleet_update({"a": a, "b": b}, _source(), 3,
                              phases=phases))
    assert a.version == 0 and b.version == 0
    assert "rollback_weight_update" in a.calls and "rollback_weight_update" not in b.calls
    for w in (a, b):
        assert w.calls[-1] == "continue_generation" and "abort_weight_update" in w.calls
        assert "finish_weight_update" not in w.calls
    assert {"pause", "transfer", "load", "commit", "resume"} <= set(phases)


def _source():
    return DISK


def test_a_staging_failure_drops_every_session_and_frees_nothing_twice():
    a, b = FakeWorker("a", fail="update_weights_from_disk"), FakeWorker("b")
    with pytest.raises(FleetUpdateFailed, match="a: update_weights_from_disk broke"):
        _run(run_fleet_update({"a": a, "b": b}, _source(), 1, release=["kv_cache"],
                              pause_mode="abort"))
    for w in (a, b):
        assert "commit_weight_update" not in w.calls and "abort_weight_update" in w.calls
        assert w.calls[-2:] == ["resume_memory_occupation", "continue_generation"]


def test_keep_paused_and_no_pause_and_bad_plans():
    a = FakeWorker("a")
    out = _run(run_fleet_update({"a": a}, _source(), 2, keep_paused=True))
    assert out["weight_version"] == 2 and a.version == 2
    assert "continue_generation" not in a.calls and a.calls[0] == "pause_generation"
    b = FakeWorker("b")
    _run(run_fleet_update({"b": b}, _source(), 2, pause_mode=None))
    assert "pause_generation" not in b.calls and "continue_generation" not in b.calls
    with pytest.raises(ValueError, match="release_memory may only hold"):
        _run(run_fleet_update({"a": a}, _source(), 3, release=["weights"]))
    with pytest.raises(ValueError, match="needs pause_mode abort or retract"):
        _run(run_fleet_update({"a": a}, _source(), 3, pause_mode="in_place", release=["kv_cache"]))
    with pytest.raises(ValueError, match="pause_mode must be one of"):
        _run(run_fleet_update({"a": a}, _source(), 3, pause_mode="nap"))


def test_a_restarted_worker_replays_a_disk_update_or_stays_stale_after_a_tensor_one():
    weights = FleetWeights()
    recs = [Rec("a", FakeWorker("a")), Rec("b", FakeWorker("b"))]
    fresh = Rec("c", FakeWorker("c"))
    assert _run(weights.catch_up(fresh)) is None  # version 0: nothing to do
    _run(weights.update(recs, DISK, None, "retract", [], False))
    assert weights.version == 1 and [r.weight_version for r in recs] == [1, 1]
    assert _run(weights.catch_up(fresh)) is None
    assert fresh.weight_version == 1 and fresh.handle.calls == [
        "begin_weight_update", "update_weights_from_disk", "end_weight_update"]
    with pytest.raises(ValueError, match="weight_version must be an integer greater than 1"):
        _run(weights.update(recs, DISK, 1, "retract", [], False))
    _run(weights.update(recs, TensorWeights(payload="ref"), 5, "retract", [], False))
    late = Rec("d", FakeWorker("d"))
    reason = _run(weights.catch_up(late))
    assert "fleet is at 5" in reason and weights.stale == {"d"} and late.weight_version == 0
    broken = Rec("e", FakeWorker("e", fail="update_weights_from_disk"))
    weights._replay = _source()
    assert "could not take weight version 5" in _run(weights.catch_up(broken))
    assert "abort_weight_update" in broken.handle.calls and weights.stale == {"d", "e"}


def test_string_labels_and_a_refused_version_over_the_fleet():
    """A label is stamped on every worker and may repeat; an int not above every int the
    fleet served is refused before any worker is paused or opens a session, and the next
    valid call succeeds; a restored controller keeps the bound."""
    weights = FleetWeights()
    recs = [Rec("a", FakeWorker("a")), Rec("b", FakeWorker("b"))]
    _run(weights.update(recs, DISK, 4, "retract", [], False))
    out = _run(weights.update(recs, DISK, "v1", "retract", [], False))
    assert out["weight_version"] == "v1" and weights.version == "v1"
    assert [(r.weight_version, r.handle.version) for r in recs] == [("v1", "v1"), ("v1", "v1")]
    calls = [list(r.handle.calls) for r in recs]
    for refused in (4, 3):
        with pytest.raises(VersionRefused, match="weight_version must be an integer greater "
                                                 "than 4"):
            _run(weights.update(recs, DISK, refused, "retract", [], False))
    assert [r.handle.calls for r in recs] == calls  # nothing paused, staged or opened
    assert weights.version == "v1"
    assert _run(weights.update(recs, DISK, "v1", "retract", [], False))["weight_version"] == "v1"
    assert _run(weights.update(recs, DISK, None, "retract", [], False))["weight_version"] == 5
    restored = FleetWeights()
    restored.restore("v2", DISK, set(), 5)
    with pytest.raises(VersionRefused, match="greater than 5"):
        _run(restored.update(recs, DISK, 5, "retract", [], False))
    fresh = Rec("c", FakeWorker("c"))
    assert _run(restored.catch_up(fresh)) is None and fresh.weight_version == "v2"


def test_a_fleet_rename_checks_first_and_names_a_worker_that_failed():
    weights = FleetWeights()
    recs = [Rec("a", FakeWorker("a")), Rec("b", FakeWorker("b", fail="update_weight_version"))]
    _run(weights.update(recs, DISK, 2, "retract", [], False))
    calls = [list(r.handle.calls) for r in recs]
    with pytest.raises(VersionRefused, match="greater than 2"):
        _run(weights.relabel(recs, 2))
    assert [r.handle.calls for r in recs] == calls and weights.version == 2
    with pytest.raises(FleetUpdateFailed, match="b: update_weight_version broke on b"):
        _run(weights.relabel(recs, "step-2"))
    assert weights.version == "step-2" and [r.weight_version for r in recs] == ["step-2", 2]
    out = _run(weights.relabel(recs, 3))
    assert out == {"weight_version": 3, "previous_version": "step-2", "workers": ["a", "b"]}
    assert [(r.weight_version, r.handle.version) for r in recs] == [(3, 3), (3, 3)]
    weights.stale = {"b"}  # left behind by a restart: it serves other weights
    recs[1].weight_version = recs[1].handle.version = 0
    assert _run(weights.relabel(recs, "step-3"))["workers"] == ["a"]
    assert [r.weight_version for r in recs] == ["step-3", 0] and recs[1].handle.version == 0


def test_a_worker_restarted_after_only_renames_takes_the_name_and_serves():
    """No update ran, only POST /update_weight_version: the weights a restarted worker
    loads are the fleet's, so it takes the fleet's name and serves (it used to stay out of
    routing for good, as if a tensor update had been lost)."""
    weights = FleetWeights()
    recs = [Rec("a", FakeWorker("a"))]
    _run(weights.relabel(recs, "base-v2"))
    fresh = Rec("b", FakeWorker("b"))
    assert _run(weights.catch_up(fresh)) is None
    assert fresh.weight_version == fresh.handle.version == "base-v2" and not weights.stale
    assert fresh.handle.calls == ["update_weight_version"]
    broken = Rec("c", FakeWorker("c", fail="update_weight_version"))
    assert "could not take weight version 'base-v2'" in _run(weights.catch_up(broken))
    assert weights.stale == {"c"}
    _run(weights.update(recs, TensorWeights(payload="ref"), 7, "retract", [], False))
    assert "fleet is at 7" in _run(weights.catch_up(Rec("d", FakeWorker("d"))))


class LocalWorker:
    """A real Engine behind the actor handle's call shape (``handle.verb.remote(...)``)."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, method):
        verb = getattr(self.engine, method)

        class _Method:
            @staticmethod
            def remote(*args):
                return asyncio.to_thread(verb, *args)
        return _Method


def test_a_worker_started_after_an_adapter_update_from_disk_catches_up(
        tiny_llama_dir, lora_adapters, tmp_path):
    """The fleet's LoRA update runs as a session on every worker; a worker started later
    loads the fleet's adapter folder and replays the .safetensors files applied since, under
    the adapter's version. After an update from tensors it cannot: the record says so."""
    from safetensors.torch import load_file, save_file

    from radixray import Engine
    from radixray.actors.fleet_lora import FleetAdapters
    from radixray.cluster.metrics import WeightUpdateMetrics
    old = load_file(f"{lora_adapters['alpha']}/adapter_model.safetensors")
    save_file({n: 3 * t for n, t in old.items() if ".lora_B." in n}, str(tmp_path / "d.safetensors"))
    fleet = FleetAdapters({"alpha": lora_adapters["alpha"]})
    metrics = WeightUpdateMetrics()
    greedy = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}

    def start():
        return Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=1024,
                      **fleet.engine_options())

    def alpha(engine):
        out = engine.generate(input_ids=[5, 9, 40, 3], sampling_params=greedy, lora_path="alpha")
        return out["output_ids"], out["meta_info"]["lora_version"]

    with start() as first:
        was = alpha(first)
        out = _run(fleet.update([Rec("w0", LocalWorker(first))],
                                DiskWeights(str(tmp_path / "d.safetensors"), lora_name="alpha"),
                                "rl-1", None, [], False, asyncio.Lock(), metrics))
        assert (out["lora_version"], out["workers"]) == ("rl-1", ["w0"])
        now = alpha(first)
        assert now[1] == "rl-1" and now[0] != was[0] and first.get_weight_version() == 0
        with pytest.raises(VersionRefused, match="adapter 'alpha'"):
            _run(fleet.update([Rec("w0", LocalWorker(first))],
                              DiskWeights(lora_adapters["alpha"], lora_name="alpha"), 0, None,
                              [], False, asyncio.Lock(), metrics))
        with start() as later:
            _run(fleet.catch_up(Rec("w1", LocalWorker(later))))
            assert alpha(later) == now
        _run(fleet.update([Rec("w0", LocalWorker(first))],
                          TensorWeights(payload=old, lora_name="alpha"), 2, None, [], False,
                          asyncio.Lock(), metrics))
        assert alpha(first) == (was[0], 2)
        # the two updates that ran are counted as the adapter's; the refused one never started
        assert metrics.updates.labels("ok", "adapter")._value.get() == 2
        assert metrics.updates.labels("ok", "model")._value.get() == 0
        assert fleet.updates["alpha"].replay is None  # a later worker cannot repeat it
