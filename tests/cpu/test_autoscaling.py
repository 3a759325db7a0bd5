"""The autoscaler's decision rule (cluster/autoscaling.py) and its config section, without
Ray: delays, bounds, hysteresis, latency signals and per-role prefill-decode decisions."""

from types import SimpleNamespace

import pytest

from radixray.cluster.autoscaling import (
    LatencyDeltas,
    RoleAutoscaler,
    RolePolicy,
    RoleSample,
    role_sample,
)
from radixray.cluster.autoscaling_metrics import AutoscalingMetrics
from radixray.cluster.config import ConfigError, ServeConfig
from radixray.cluster.messages import WorkerLoad


def _policy(**kw) -> RolePolicy:
    base = dict(role="unified", min_workers=1, max_workers=4, targets={"ongoing_requests": 2.0},
                upscale_delay_s=3.0, downscale_delay_s=10.0, look_back_period_s=1.0,
                downscale_tolerance=0.1)
    return RolePolicy(**{**base, **kw})


def _run(scaler: RoleAutoscaler, samples) -> list:
    return [scaler.decide(s) for s in samples]


def _load(at: float, workers: int, ongoing: float, **kw) -> RoleSample:
    return RoleSample(at=at, workers=workers, serving=workers, ongoing_requests=ongoing, **kw)


def test_upscale_waits_for_its_delay_then_takes_the_latest_need():
    scaler = RoleAutoscaler(_policy(look_back_period_s=0.5))
    # 1 worker, 5 requests in flight against a target of 2 per worker: needs 3 workers
    out = _run(scaler, [_load(t, 1, 5.0) for t in (0.0, 1.0, 2.0)])
    assert [d.direction for d in out] == ["hold"] * 3
    assert [d.proposed for d in out] == [3, 3, 3]  # pending, not acted on
    assert out[-1].pending_s == pytest.approx(2.0)
    d = scaler.decide(_load(3.0, 1, 7.0))  # 3 s of proposals up: act, with the latest need
    assert (d.direction, d.current, d.desired) == ("up", 1, 4)
    assert d.inputs["ongoing_requests"]["needs"] == pytest.approx(3.5)
    assert "ongoing_requests" in d.describe() and "1 -> 4" in d.describe()


def test_a_break_restarts_the_delay():
    scaler = RoleAutoscaler(_policy(look_back_period_s=0.1))
    _run(scaler, [_load(0.0, 1, 5.0), _load(2.0, 1, 5.0)])
    assert scaler.decide(_load(2.5, 1, 1.0)).direction == "hold"  # within target: a break
    out = _run(scaler, [_load(t, 1, 5.0) for t in (3.0, 5.0)])
    assert [d.direction for d in out] == ["hold", "hold"]  # 2 s since the break, not 3
    assert scaler.decide(_load(6.0, 1, 5.0)).direction == "up"


def test_bounds_clamp_and_apply_at_once():
    scaler = RoleAutoscaler(_policy(max_workers=2, upscale_delay_s=0.0))
    d = scaler.decide(_load(0.0, 1, 100.0))
    assert (d.direction, d.desired) == ("up", 2)  # needs 50, max 2
    d = scaler.decide(_load(1.0, 2, 100.0))
    assert (d.direction, d.desired) == ("hold", 2) and "max bound" in d.reason
    # a fleet outside its bounds (a worker lost for good) moves back without a delay
    slow = RoleAutoscaler(_policy(min_workers=2, upscale_delay_s=100.0))
    d = slow.decide(_load(0.0, 1, 0.0))
    assert (d.direction, d.desired) == ("up", 2) and "outside" in d.reason
    d = RoleAutoscaler(_policy(max_workers=2)).decide(_load(0.0, 3, 0.0))
    assert (d.direction, d.desired) == ("down", 2)


def test_downscale_has_hysteresis_and_its_own_delay():
    scaler = RoleAutoscaler(_policy(downscale_delay_s=5.0, look_back_period_s=0.1))
    # 2 workers, 1.9 in flight: one worker would run at 95% of target: inside the 10%
    # tolerance, so the fleet holds
    assert all(d.direction == "hold" and d.proposed == 2
               for d in _run(scaler, [_load(t, 2, 1.9) for t in range(0, 20, 2)]))
    # 1.7 in flight: one worker at 85% of target, below the tolerance: down after 5 s
    out = _run(scaler, [_load(t, 2, 1.7) for t in (20.0, 22.0, 24.0, 25.0)])
    assert [d.direction for d in out] == ["hold", "hold", "hold", "down"]
    assert out[-1].desired == 1
    # and the smaller fleet does not scale straight back up on the same load
    d = scaler.decide(_load(26.0, 1, 1.7))
    assert d.direction == "hold" and d.proposed == 1


def test_no_downscale_while_a_worker_starts():
    scaler = RoleAutoscaler(_policy(downscale_delay_s=2.0, look_back_period_s=0.1))
    # just scaled to 2: one serves, one starts; the load fell meanwhile
    out = _run(scaler, [RoleSample(at=t, workers=2, serving=0, starting=2) for t in range(5)])
    assert all(d.direction == "hold" and d.inputs == {} for d in out)  # no data yet
    out = _run(scaler, [RoleSample(at=t, workers=2, serving=1, starting=1,
                                   ongoing_requests=0.5) for t in range(5, 10)])
    assert all(d.direction == "hold" and "still starting" in d.reason for d in out)
    # once it is ready the down wish waits its full delay from then
    out = _run(scaler, [_load(t, 2, 0.5) for t in (10.0, 11.0, 12.0)])
    assert [d.direction for d in out] == ["hold", "hold", "down"]


def test_idle_goes_to_min_and_no_data_holds():
    scaler = RoleAutoscaler(_policy(min_workers=1, downscale_delay_s=0.0))
    d = scaler.decide(_load(0.0, 3, 0.0))
    assert (d.direction, d.desired) == ("down", 1)
    # workers all starting (nothing serving yet): no signal, no move
    d = RoleAutoscaler(_policy(upscale_delay_s=0)).decide(RoleSample(at=0.0, workers=2))
    assert d.direction == "hold" and d.inputs == {}


def test_the_window_averages_load_and_restarts_after_a_change():
    scaler = RoleAutoscaler(_policy(upscale_delay_s=0.0, look_back_period_s=10.0))
    # a one-sample spike averaged with quiet samples stays within target
    _run(scaler, [_load(t, 2, 0.0) for t in range(5)])
    d = scaler.decide(_load(5.0, 2, 12.0))
    assert d.inputs["ongoing_requests"]["needs"] == pytest.approx(1.0)
    assert d.direction == "hold"
    d = scaler.decide(_load(6.0, 2, 12.0))  # (0*4 + 12 + 12) / 6 samples = 4 in flight: 2
    assert d.direction == "hold"
    d = scaler.decide(_load(7.0, 2, 30.0))  # 54 / 7 -> needs 3.9: up
    assert (d.direction, d.desired) == ("up", 4)
    assert not scaler.window  # after a change the old fleet's samples are gone


def test_several_targets_take_the_largest_need():
    scaler = RoleAutoscaler(_policy(targets={"ongoing_requests": 8.0, "kv_usage": 0.5},
                                    upscale_delay_s=0.0))
    d = scaler.decide(_load(0.0, 2, 4.0, kv_usage=1.8))  # KV 90% each: needs 3.6 workers
    assert (d.direction, d.desired) == ("up", 4)
    assert "kv_usage" in d.reason and "ongoing_requests" not in d.reason


def _pd_scalers(cfg: dict) -> dict[str, RoleAutoscaler]:
    return {role: RoleAutoscaler(p)
            for role, p in ServeConfig.parse(cfg).autoscaling_policies().items()}


PD = {"server": {"slo_ttft_s": 0.5, "slo_tpot_s": 0.05},
      "fleet": {"prefill_workers": 1, "decode_workers": 1, "autoscaling": {
          "upscale_delay_s": 0, "downscale_delay_s": 0, "look_back_period_s": 5,
          "prefill": {"min_workers": 1, "max_workers": 3},
          "decode": {"min_workers": 1, "max_workers": 2}}}}


def test_prefill_heavy_load_scales_prefill_not_decode():
    scalers = _pd_scalers(PD)
    assert scalers["prefill"].policy.targets == {"ttft_s": 0.5, "queue_length": 2.0}
    assert scalers["decode"].policy.targets == {"tpot_s": 0.05, "kv_usage": 0.8}
    # long prompts: TTFT 1.2 s (SLO 0.5) and 3 queued on the prefill worker; decode keeps
    # TPOT at 20 ms with little KV in use
    prefill = scalers["prefill"].decide(RoleSample(
        at=0.0, workers=1, serving=1, ongoing_requests=4, queue_length=3,
        ttft_s=(6.0, 5)))
    decode = scalers["decode"].decide(RoleSample(
        at=0.0, workers=1, serving=1, ongoing_requests=4, kv_usage=0.1, tpot_s=(0.1, 5)))
    assert (prefill.direction, prefill.desired) == ("up", 3)  # 1 x 1.2 / 0.5 = 2.4 -> 3
    assert decode.direction == "hold" and decode.desired == 1


def test_decode_scales_on_tpot_and_kv_and_prefill_down_on_headroom():
    scalers = _pd_scalers(PD)
    decode = scalers["decode"].decide(RoleSample(
        at=0.0, workers=1, serving=1, kv_usage=0.95, tpot_s=(0.07, 1)))
    assert (decode.direction, decode.desired) == ("up", 2)
    prefill = scalers["prefill"].decide(RoleSample(
        at=0.0, workers=3, serving=3, queue_length=0, ttft_s=(0.1, 1)))
    assert (prefill.direction, prefill.desired) == ("down", 1)  # 3 x 0.1/0.5/0.9 = 0.67


def test_a_fixed_role_of_a_pd_fleet_gets_no_policy():
    cfg = {**PD, "fleet": {**PD["fleet"], "autoscaling": {"prefill": {"max_workers": 2}}}}
    assert set(_pd_scalers(cfg)) == {"prefill"}


def _rec(worker_id, role, state, load, generation=0, retiring=False):
    return SimpleNamespace(worker_id=worker_id, role=role, state=state, load=load,
                           generation=generation, retiring=retiring)


def test_role_sample_sums_ready_workers_and_takes_latency_deltas():
    deltas = LatencyDeltas()
    a = WorkerLoad(num_running_reqs=2, num_queue_reqs=3, token_usage=0.5, inflight=4,
                   ttft_s_sum=2.0, ttft_s_count=4)
    recs = [_rec("worker-0", "prefill", "ready", a),
            _rec("worker-1", "prefill", "starting", None),
            _rec("worker-2", "prefill", "draining", WorkerLoad(inflight=9), retiring=True),
            _rec("worker-4", "prefill", "dead", None),  # restarted by the controller
            _rec("worker-5", "prefill", "failed", None),  # past its restart budget
            _rec("worker-3", "decode", "ready", WorkerLoad(inflight=7))]
    s = role_sample("prefill", recs, deltas, at=1.0)
    assert (s.workers, s.serving, s.starting) == (3, 1, 2)  # starting and dead count
    assert (s.ongoing_requests, s.queue_length, s.kv_usage) == (5, 3, 0.5)
    assert s.ttft_s == (2.0, 4)
    a.ttft_s_sum, a.ttft_s_count = 3.5, 5
    assert role_sample("prefill", recs, deltas, at=2.0).ttft_s == (1.5, 1)
    # a restarted worker (new generation) starts from its own zero
    recs[0] = _rec("worker-0", "prefill", "ready", WorkerLoad(ttft_s_sum=0.3, ttft_s_count=1),
                   generation=1)
    assert role_sample("prefill", recs, deltas, at=3.0).ttft_s == (0.3, 1)


def test_metrics_count_decisions_and_show_desired_and_current():
    from prometheus_client import generate_latest
    metrics = AutoscalingMetrics(["unified"])
    scaler = RoleAutoscaler(_policy(upscale_delay_s=0.0))
    metrics.observe(scaler.decide(_load(0.0, 1, 5.0)))
    text = generate_latest(metrics.registry).decode()
    assert 'radixray:autoscaling_decisions_total{direction="up",role="unified"} 1.0' in text
    assert 'radixray:autoscaling_decisions_total{direction="down",role="unified"} 0.0' in text
    assert 'radixray:autoscaling_desired_workers{role="unified"} 3.0' in text
    assert 'radixray:autoscaling_current_workers{role="unified"} 1.0' in text


@pytest.mark.parametrize("fleet, field", [
    ({"workers": 3, "autoscaling": {"min_workers": 1, "max_workers": 2}}, "fleet.workers=3"),
    ({"autoscaling": {"min_workers": 2, "max_workers": 1}}, "fleet.autoscaling.max_workers"),
    ({"autoscaling": {"target_ongoing_requests": None}}, "needs a target"),
    ({"autoscaling": {"upscale_delay_s": -1}}, "fleet.autoscaling.upscale_delay_s"),
    ({"autoscaling": {"target_kv_usage": 1.5}}, "fleet.autoscaling.target_kv_usage"),
    ({"autoscaling": {"prefill": {"max_workers": 2}}}, "apply only to a prefill-decode"),
    ({"prefill_workers": 1, "decode_workers": 1, "autoscaling": {"max_workers": 2}},
     "fleet.autoscaling.max_workers applies to unified"),
    ({"prefill_workers": 2, "decode_workers": 1,
      "autoscaling": {"prefill": {"min_workers": 1, "max_workers": 1}}},
     "fleet.prefill_workers=2"),
    ({"autoscaling": {"decison_interval_s": 1}}, "fleet.autoscaling.decison_interval_s"),
])
def test_config_errors_name_the_field(fleet, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.").replace("=", "=")):
        ServeConfig.parse({"fleet": fleet})


@pytest.mark.parametrize("cfg", [PD, {"fleet": {"workers": 2, "autoscaling": {
    "max_workers": 3, "target_kv_usage": 0.7}}}], ids=["pd", "unified"])
def test_the_section_survives_a_dump_and_reload(cfg):
    """The ingress and the controller get the config as a dict dumped from the parsed one."""
    parsed = ServeConfig.parse(cfg)
    again = ServeConfig.parse(parsed.model_dump())  # as build_app passes it
    assert again.autoscaling_policies() == parsed.autoscaling_policies()
    assert again.fleet_key() == parsed.fleet_key()


def test_autoscaled_workers_get_their_own_bundles():
    cfg = ServeConfig.parse({"server": {"worker_num_cpus": 0.5},
                             "fleet": {"autoscaling": {"max_workers": 3}}})
    assert cfg.worker_bundles() == []  # no shared group: one per worker
    assert cfg.role_bundles("unified") == [{"CPU": 0.5}]
    assert cfg.fleet.max_workers() == 3
    assert ServeConfig.parse({"fleet": {"workers": 2}}).fleet.max_workers() == 2
    with pytest.raises(ConfigError, match="engine.ep_size"):
        ServeConfig.parse({"engine": {"ep_size": 2}, "fleet": {"autoscaling": {}}})


def test_a_fixed_fleet_exports_the_same_series():
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry

    from radixray.cluster.autoscaling_metrics import fixed_fleet_families
    from radixray.cluster.metrics import FleetCollector
    collector = FleetCollector()
    collector.update([fixed_fleet_families({"prefill": 1, "decode": 2})])
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'radixray:autoscaling_current_workers{role="decode"} 2.0' in text
    assert 'radixray:autoscaling_desired_workers{role="prefill"} 1.0' in text
    assert 'radixray:autoscaling_decisions_total{direction="up",role="decode"} 0.0' in text
