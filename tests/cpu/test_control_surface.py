"""One control surface: Engine, EngineWorker and the controller define every verb of their
protocol (engine/control.py) with the protocol's parameters, each worker verb calls the
Engine's, and a verb cannot be added in one place only."""

from __future__ import annotations

import asyncio
import inspect

import pytest
import torch

from radixray.actors.controller import Controller
from radixray.actors.engine_worker import EngineWorker
from radixray.cluster.fleet_control import FLEET_ONLY_VERBS, FLEET_VERBS, FleetControl
from radixray.engine.control import (
    CONTROL_VERBS,
    ENGINE_ONLY_VERBS,
    EngineControl,
)
from radixray.engine.engine import Engine
from radixray.engine.faults import FailWeightUpdate, FaultInjector
from radixray.engine.weights.version import VersionRefused

# Methods Engine and EngineWorker share that are not control verbs: the pair's transport
# (room messages, status and the handshake) and the lifecycle.
SHARED_NOT_CONTROL = {"pd_deliver", "pd_status", "pd_probe", "shutdown"}


# Ray's tracing hook adds this keyword to an actor class's methods in place once the class
# has been made a remote actor in this process (any earlier test that started a worker).
RAY_ADDED = {"_ray_trace_ctx"}


def _params(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default, p.annotation)
            for p in inspect.signature(fn).parameters.values() if p.name not in RAY_ADDED]


def _mismatches(cls: type, protocol: type, verbs: list[str], coroutines: bool) -> list[str]:
    wrong = []
    for name in verbs:
        fn = getattr(cls, name, None)
        if fn is None:
            wrong.append(f"{cls.__name__}.{name} is missing")
            continue
        want = getattr(protocol, name)
        if _params(fn) != _params(want):
            wrong.append(f"{cls.__name__}.{name}{inspect.signature(fn)} != "
                         f"{protocol.__name__}.{name}{inspect.signature(want)}")
        if inspect.iscoroutinefunction(inspect.unwrap(fn)) != coroutines:
            wrong.append(f"{cls.__name__}.{name} must {'' if coroutines else 'not '}be async")
    return wrong


@pytest.mark.parametrize("cls, protocol, verbs, coroutines", [
    (Engine, EngineControl, CONTROL_VERBS, False),
    (EngineWorker, EngineControl, CONTROL_VERBS, True),
    (Controller, FleetControl, FLEET_VERBS, True),
], ids=["engine", "worker", "controller"])
def test_each_implementer_defines_every_verb_with_the_protocols_parameters(
        cls, protocol, verbs, coroutines):
    wrong = _mismatches(cls, protocol, verbs, coroutines)
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_a_missing_verb_and_other_parameters():
    class Partial:
        def pause_generation(self, how: str = "abort") -> int:
            return 0
    wrong = _mismatches(Partial, EngineControl, ["pause_generation", "flush_cache"], False)
    assert len(wrong) == 2 and "Partial.flush_cache is missing" in wrong


def test_every_engine_verb_is_a_fleet_verb_or_declared_engine_only():
    engine, fleet = set(CONTROL_VERBS), set(FLEET_VERBS)
    assert ENGINE_ONLY_VERBS <= engine and FLEET_ONLY_VERBS <= fleet
    assert engine - ENGINE_ONLY_VERBS == fleet - FLEET_ONLY_VERBS


def _public(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if not n.startswith("_") and callable(v)}


def test_a_method_engine_and_worker_share_is_a_verb():
    """A new control verb written on both but left out of the protocol fails here."""
    shared = _public(Engine) & _public(EngineWorker)
    assert shared - set(CONTROL_VERBS) - SHARED_NOT_CONTROL == set()


@pytest.mark.parametrize("name", CONTROL_VERBS)
def test_a_worker_verb_calls_the_engines(name):
    """The body is written once, in the Engine; a scheduler-thread verb is awaited through
    submit_verb (no thread held while a step runs)."""
    source = inspect.getsource(getattr(EngineWorker, name))
    assert f"self.engine.{name}" in source, source
    if getattr(getattr(Engine, name), "loop_body", None) is not None:
        assert f"self._later(self.engine.{name}" in source, source


def test_submit_verb_takes_only_scheduler_thread_verbs_of_its_engine(eng):
    async def flush() -> bool:
        return await asyncio.wrap_future(eng.submit_verb(eng.flush_cache))
    assert asyncio.run(flush()) is True
    with pytest.raises(TypeError, match="not a scheduler-thread verb"):
        eng.submit_verb(eng.get_weight_version)


def test_the_worker_runs_the_engines_verbs(tiny_llama_dir):
    """The worker's verbs answer what the engine's do; a fault attached by a test reaches
    the engine's weight-update step."""
    worker = EngineWorker({"model": tiny_llama_dir, "dtype": "float32",
                           "max_total_tokens": 1024}, warmup=False)

    async def run() -> None:
        assert await worker.pause_generation("retract") == 0
        load = await worker.load()
        assert load.paused == "retract" and load.max_total_num_tokens > 0
        assert await worker.continue_generation() is True
        assert await worker.flush_cache() is True
        kv = await worker.check_kv_conservation()
        assert kv["free"] + kv["cached"] == kv["pool"] and kv["running"] == 0
        await worker.attach_fault_injector(FaultInjector(FailWeightUpdate("prepare")))
        await worker.begin_weight_update()
        with pytest.raises(RuntimeError, match="injected weight update fault at prepare"):
            await worker.prepare_weight_update(1)
        assert await worker.abort_weight_update() is True
        assert await worker.get_weight_version() == 0
        await worker.attach_fault_injector(None)
        await worker.begin_weight_update()
        await worker.update_weights_from_tensor({"model.norm.weight": torch.ones(64)})
        with pytest.raises(VersionRefused, match="weight_version"):
            await worker.end_weight_update(0)  # refused: the session and its tensor stay
        assert (await worker.end_weight_update("v1"))["weight_version"] == "v1"
        assert await worker.get_weight_version() == "v1"
        assert (await worker.load()).weight_version == "v1"
        renamed = await worker.update_weight_version("v1-final")
        assert renamed == {"weight_version": "v1-final", "previous_version": "v1"}
        names = {f.name for f in await worker.metric_families()}
        assert "radixray:weight_version_info" in names and "radixray:weight_version" not in names
    try:
        asyncio.run(run())
    finally:
        asyncio.run(worker.shutdown())
