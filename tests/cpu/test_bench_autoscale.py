"""``bench serve --load-steps`` and ``bench autoscale``: the phase schedule, the per-phase
split, the fleet's worker-seconds from sampled /metrics (parsed from real prometheus-client
text), a whole trace against a local fake server, the fleets' configs, table and plot."""

import argparse
import asyncio
import json

import pytest
from model_fixtures import byte_bpe_tokenizer
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from serving_helpers import uvicorn_in_thread

from radixray.bench import autoscale, autoscale_report, fleet_sampler, load_steps, serve_client
from radixray.bench.fleet_sampler import FleetSample
from radixray.bench.load_steps import LoadStep
from radixray.bench.serve_metrics import RequestRecord, percentile
from radixray.cluster.autoscaling import Decision
from radixray.cluster.autoscaling_metrics import AutoscalingMetrics, fixed_fleet_families
from radixray.cluster.config import ServeConfig

# ----------------------------------------------------------------------------- schedule


def test_parse_load_steps_and_errors():
    steps = load_steps.parse_load_steps("30s@0.2, 60s@4,15.5s@0")
    assert steps == [LoadStep(30, 0.2), LoadStep(60, 4), LoadStep(15.5, 0)]
    assert load_steps.format_load_steps(steps) == "30s@0.2,60s@4,15.5s@0"
    assert load_steps.phase_bounds(steps) == [(0, 30), (30, 90), (90, 105.5)]
    for bad, says in (("30@0.2", "'30@0.2' is not"), ("0s@1", "lasts no time"),
                      ("10s@0,5s@0", "sends no request"), ("10s@-1", "is not")):
        with pytest.raises(ValueError, match="--load-steps") as e:
            load_steps.parse_load_steps(bad)
        assert says in str(e.value)


def test_arrivals_are_seeded_poisson_per_phase():
    steps = [LoadStep(200, 0.5), LoadStep(100, 10), LoadStep(50, 0), LoadStep(200, 0.5)]
    arrivals = load_steps.step_arrivals(steps, seed=7)
    assert arrivals == load_steps.step_arrivals(steps, seed=7)
    assert arrivals != load_steps.step_arrivals(steps, seed=8)
    assert [t for t, _ in arrivals] == sorted(t for t, _ in arrivals)
    bounds = load_steps.phase_bounds(steps)
    for t, k in arrivals:
        assert bounds[k][0] <= t < bounds[k][1]
    counts = [sum(1 for _, k in arrivals if k == p) for p in range(4)]
    assert counts[2] == 0  # a rate of 0 sends nothing
    # a seeded draw: the counts of a Poisson process, within 4 standard deviations of rate x T
    for n, step in zip(counts, steps):
        mean = step.rate * step.duration_s
        assert abs(n - mean) <= 4 * mean ** 0.5 + 1e-9, (n, step)
    burst = [t for t, k in arrivals if k == 1]
    gaps = [b - a for a, b in zip(burst, burst[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.15)  # mean gap 1 / rate
    # a phase's arrivals do not move when another phase changes
    louder = load_steps.step_arrivals([LoadStep(200, 0.5), LoadStep(100, 20), LoadStep(50, 0),
                                       LoadStep(200, 0.5)], seed=7)
    for phase in (0, 3):
        assert [t for t, k in louder if k == phase] == [t for t, k in arrivals if k == phase]


# ----------------------------------------------------------------------------- per phase


def _rec(i, ttft=None, error=None, out=10):
    ok = error is None
    return RequestRecord(index=i, success=ok, error=error, ttft=ttft if ok else None,
                         latency=(ttft or 0) + 1.0 if ok else None, prompt_tokens=5,
                         output_tokens=out if ok else 0)


def test_records_split_by_the_phase_they_were_sent_in():
    steps = [LoadStep(10, 0.2), LoadStep(20, 2), LoadStep(10, 0.2)]
    quiet = [_rec(0, 0.1), _rec(1, 0.2)]
    burst = [_rec(2, 0.5), _rec(3, 2.0), _rec(4, 4.0), _rec(5, error="HTTP 503: queue_full"),
             _rec(6, error="HTTP 503: queue_full"), _rec(7, error="ReadTimeout: ")]
    late = [_rec(8, 0.3)]
    phase_of = {**{r.index: 0 for r in quiet}, **{r.index: 1 for r in burst}, 8: 2}
    phases = load_steps.phase_summaries(quiet + burst + late, phase_of, steps,
                                        slo_ttft_ms=1000)
    assert [p["num_requests"] for p in phases] == [2, 6, 1]
    assert [p["rejected_503"] for p in phases] == [0, 2, 0]
    assert [p["other_failures"] for p in phases] == [0, 1, 0]
    assert phases[1]["failure_errors"] == {"ReadTimeout: ": 1}  # what failed, 503s apart
    assert phases[1]["p99_ttft_ms"] == pytest.approx(percentile([500, 2000, 4000], 99))
    assert phases[1]["output_throughput"] == pytest.approx(30 / 20)  # 3 x 10 tokens / 20 s
    assert phases[1]["goodput"] == pytest.approx(1 / 20)  # one burst request within 1 s
    assert (phases[2]["start_s"], phases[2]["end_s"], phases[2]["step"]) == (30, 40, "10s@0.2")
    points = load_steps.request_points(burst, {r.index: 10.0 + r.index for r in burst})
    assert [p["outcome"] for p in points] == ["ok", "ok", "ok", "503", "503", "failed"]
    assert points[0] == {"t": 12.0, "ttft_s": 0.5, "outcome": "ok"}


# ----------------------------------------------------------------------------- workers


def _sample(t, unified=None, desired=None, up=0, down=0, **roles):
    current = dict(roles)
    if unified is not None:
        current["unified"] = unified
    decisions = {"unified:up": up, "unified:down": down} if unified is not None else {}
    return FleetSample(t, current, {"unified": desired or unified} if unified else {}, decisions)


def test_worker_seconds_integrate_a_step_function():
    timeline = [_sample(-0.5, 1), _sample(10, 2, up=1), _sample(20, 2, up=1),
                _sample(30, 1, up=1, down=1)]
    assert fleet_sampler.worker_seconds(timeline, 0, 40) == {"unified": 10 + 2 * 20 + 10}
    assert fleet_sampler.worker_seconds(timeline, 15, 25) == {"unified": 20}
    assert fleet_sampler.max_workers(timeline, 0, 40) == {"unified": 2, "total": 2}
    assert fleet_sampler.max_workers(timeline, 31, 40) == {"unified": 1, "total": 1}
    assert fleet_sampler.decisions_between(timeline, 0, 40) == {"unified:up": 1,
                                                                "unified:down": 1}
    assert fleet_sampler.decisions_between(timeline, 0, 15) == {"unified:up": 1,
                                                                "unified:down": 0}
    # before a role's first sample its first count holds; roles add up per sample
    pd = [FleetSample(2, {"prefill": 1}), FleetSample(4, {"prefill": 2, "decode": 1}),
          FleetSample(8, {"prefill": 1, "decode": 2})]
    assert fleet_sampler.worker_seconds(pd, 0, 10) == {"prefill": 4 * 1 + 4 * 2 + 2 * 1,
                                                       "decode": 8 * 1 + 2 * 2}
    assert fleet_sampler.max_workers(pd) == {"prefill": 2, "decode": 2, "total": 3}
    assert fleet_sampler.worker_seconds([], 0, 10) == {}


def test_held_worker_seconds_count_a_worker_until_its_drain_ends():
    """The autoscaler's count drops a worker when its drain starts; the held count keeps it
    (starting, ready and draining all hold a placement) until it is gone."""
    states = [FleetSample(0, {"unified": 1}, states={"ready": 1}),
              FleetSample(10, {"unified": 2}, states={"ready": 1, "starting": 1}),
              FleetSample(20, {"unified": 1}, states={"ready": 1, "draining": 1}),
              FleetSample(30, {"unified": 1}, states={"ready": 1, "dead": 1})]
    assert fleet_sampler.worker_seconds(states, 0, 40) == {"unified": 10 + 20 + 10 + 10}
    assert fleet_sampler.held_worker_seconds(states, 0, 40) == 10 + 20 + 20 + 10
    assert fleet_sampler.held_worker_seconds([FleetSample(0, {"unified": 1})], 0, 5) is None


def _page(*families) -> str:
    class Fixed:
        def collect(self):
            return families
    registry = CollectorRegistry()
    registry.register(Fixed())
    return generate_latest(registry).decode()


def test_parse_real_prometheus_text():
    scaler = AutoscalingMetrics(["prefill", "decode"])
    scaler.observe(Decision("prefill", "up", current=1, desired=2, proposed=2, reason="ttft"))
    scaler.observe(Decision("prefill", "hold", current=2, desired=2, proposed=2, reason="-"))
    scaler.observe(Decision("decode", "hold", current=1, desired=1, proposed=1, reason="-"))
    other = CollectorRegistry()  # another family on the same page is left alone
    Histogram("radixray:time_to_first_token_seconds", "TTFT", ["role"],
              registry=other).labels("prefill").observe(0.3)
    states = GaugeMetricFamily("radixray:fleet_workers", "by state", labels=["state"])
    for state, n in (("starting", 1), ("ready", 2), ("draining", 0)):
        states.add_metric([state], n)
    text = _page(*scaler.families(), *other.collect(), states)
    sample = fleet_sampler.parse_fleet_metrics(text, t=3.0)
    assert sample.t == 3.0
    assert sample.current == {"prefill": 2, "decode": 1}
    assert sample.desired == {"prefill": 2, "decode": 1}
    assert sample.decisions == {"prefill:up": 1, "prefill:down": 0, "decode:up": 0,
                                "decode:down": 0}
    fixed = fleet_sampler.parse_fleet_metrics(_page(*fixed_fleet_families({"unified": 1})))
    assert fixed.current == {"unified": 1} and fixed.desired == {"unified": 1}
    assert fixed.decisions == {"unified:up": 0, "unified:down": 0}
    # an autoscaled fleet before its first round: decision counters, no worker gauges
    early = fleet_sampler.parse_fleet_metrics(_page(*AutoscalingMetrics(["unified"]).families()))
    assert early.current == {} and early.decisions == {"unified:up": 0, "unified:down": 0}
    assert sample.states == {"starting": 1, "ready": 2, "draining": 0}
    assert fleet_sampler.parse_fleet_metrics("# nothing here\n").current == {}


# ----------------------------------------------------------------------------- a whole trace


class FakeFleet:
    """An OpenAI-style streaming server with a fleet's /metrics: every second completion
    answers 503 queue_full; the first one adds a worker (an 'up' decision)."""

    def __init__(self):
        self.metrics = AutoscalingMetrics(["unified"])
        self.metrics.observe(Decision("unified", "hold", 1, 1, 1, "-"))
        self.n = 0

    def app(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"data": [{"id": "fake"}]}

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(_page(*self.metrics.families()))

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.n += 1
            if self.n == 1:
                self.metrics.observe(Decision("unified", "up", 1, 2, 2, "burst"))
                self.metrics.observe(Decision("unified", "hold", 2, 2, 2, "-"))  # next round
            if self.n % 2 == 0:
                return JSONResponse({"error": {"code": "queue_full"}}, status_code=503)

            async def stream():
                for i in range(body["max_tokens"]):
                    await asyncio.sleep(0.002)
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f'w{i} '}]})}\n\n"
                usage = {"prompt_tokens": 4, "completion_tokens": body["max_tokens"]}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(stream(), media_type="text/event-stream")
        return app


@pytest.fixture
def fake_fleet():
    fleet = FakeFleet()
    with uvicorn_in_thread(fleet.app()) as url:
        fleet.url = url
        yield fleet


def _serve_args(*argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="bench_command", required=True)
    serve_client.add_parser(sub)
    return parser.parse_args(["serve", *argv])


def test_a_trace_against_a_fleet_splits_phases_and_counts_worker_seconds(fake_fleet, capsys):
    args = _serve_args("--load-steps", "0.6s@10,0.6s@0", "--random-input-len", "8",
                       "--random-output-len", "3", "--random-range-ratio", "1",
                       "--warmup", "0", "--disable-tqdm", "--slo-ttft-ms", "10000")
    arrivals = load_steps.step_arrivals(args.load_steps, args.seed)
    summary = load_steps.run_steps(args, "fake", fake_fleet.url, "fake", byte_bpe_tokenizer(),
                                   sample_interval_s=0.1)
    n = len(arrivals)
    assert n >= 2 and summary["num_requests"] == n == fake_fleet.n
    burst, lull = summary["phases"]
    assert burst["num_requests"] == n and lull["num_requests"] == 0
    assert burst["rejected_503"] == n // 2 and burst["other_failures"] == 0
    assert burst["completed"] == n - n // 2
    assert [p["t"] for p in summary["requests"]] == [t for t, _ in arrivals]
    # the sampler saw 1 worker at the start, 2 after the first request; it ran to the end
    timeline = summary["fleet_timeline"]
    assert timeline[0]["t"] < 0 and timeline[0]["current"] == {"unified": 1}
    assert timeline[-1]["current"] == {"unified": 2} and timeline[-1]["t"] >= 1.0
    length = max(summary["duration_s"], 1.2)
    assert length < summary["worker_seconds"] < 2 * length
    assert summary["max_workers"] == 2 and summary["decisions"]["unified:up"] == 1
    assert summary["metrics_scrape_failures"] == 0
    out = capsys.readouterr().out
    assert "0.6s@10" in out and "worker-s" in out
    rows = autoscale_report.table_rows([{**summary, "fleet": "fake", "kind": "unified"}])
    assert rows[0]["burst_503"] == n // 2 and rows[0]["max_workers"] == "2"
    assert rows[0]["burst_slo_met"] == pytest.approx((n - n // 2) / n)
    assert "burst p99 TTFT s" in autoscale_report.format_table(rows)


def test_load_steps_refuses_a_sweep_and_a_rate(capsys):
    args = _serve_args("--load-steps", "1s@1", "--sweep", "1,2", "--request-rate", "3",
                       "--base-url", "http://127.0.0.1:9")
    assert serve_client.run_serve_bench(args) == 2
    assert "--load-steps sets the arrivals itself; leave out --sweep, --request-rate" in \
        capsys.readouterr().err
    args = _serve_args("--load-steps", "1s@1", "--dataset", "multi-turn")
    assert serve_client.run_serve_bench(args) == 2
    assert "--load-steps runs the random dataset" in capsys.readouterr().err


# ----------------------------------------------------------------------------- bench autoscale


def _autoscale_args(*argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    autoscale.add_parser(sub)
    return parser.parse_args(["autoscale", *argv])


@pytest.mark.parametrize("kind", autoscale.KINDS)
def test_fleet_pairs_validate_and_differ_only_in_scaling(kind):
    args = _autoscale_args("--max-queued-requests", "8")
    pair = autoscale.fleet_configs(args, kind)
    assert list(pair) == [f"{kind}-fixed", f"{kind}-autoscaled"]
    fixed, scaled = pair.values()
    assert {k: v for k, v in fixed.items() if k != "fleet"} == \
           {k: v for k, v in scaled.items() if k != "fleet"}
    configs = [ServeConfig.parse(c) for c in pair.values()]
    assert all(c.server.max_queued_requests == 8 for c in configs)
    assert configs[0].fleet.autoscaling is None
    policies = configs[1].autoscaling_policies()
    roles = ["unified"] if kind == "unified" else ["prefill", "decode"]
    assert sorted(policies) == sorted(roles)
    for p in policies.values():
        assert (p.min_workers, p.max_workers, p.upscale_delay_s, p.downscale_delay_s) == \
               (1, 2, 5.0, 20.0)
    if kind == "pd":
        assert configs[1].server.slo_ttft_s == 2.0 and configs[1].server.slo_tpot_s == 0.1


def test_autoscale_rejects_bad_flags_before_starting_anything(tmp_path, capsys):
    args = _autoscale_args("--only", "unified", "--max-queued-requests", "0",
                           "--output-dir", str(tmp_path / "out"))
    assert autoscale.run_autoscale(args) == 2
    assert "max_queued_requests" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_plot_of_two_fleets(tmp_path):
    def fleet(name, counts, outcomes):
        timeline = [{"t": t, "current": {"unified": n}, "desired": {"unified": n},
                     "decisions": {}, "states": {"ready": min(n, 1 + (t > 4))}}
                    for t, n in counts]
        requests = [{"t": float(i), "ttft_s": 0.2 * (i + 1) if o == "ok" else None,
                     "outcome": o} for i, o in enumerate(outcomes)]
        return {"fleet": name, "kind": "unified", "load_steps": "2s@1,4s@3",
                "phases": [{"rate": 1, "start_s": 0, "end_s": 2},
                           {"rate": 3, "start_s": 2, "end_s": 6}],
                "fleet_timeline": timeline, "requests": requests,
                "decisions": {"unified:up": 1} if "auto" in name else {}}
    path = autoscale_report.plot_autoscale(
        [fleet("unified-fixed", [(0, 1), (6, 1)], ["ok", "503", "ok"]),
         fleet("unified-autoscaled", [(0, 1), (3, 2), (6, 2)], ["ok", "ok", "ok"])],
        str(tmp_path / "autoscale.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_short_trace_against_a_fixed_fleet_of_a_tiny_model(tiny_llama_dir, tmp_path,
                                                             monkeypatch):
    """The whole path of one fleet: its config written, `radixray serve` started, the trace
    run with /metrics sampled, the server stopped."""
    import httpx
    from serving_helpers import RAY_ENV

    from radixray.bench import datasets
    for key, value in RAY_ENV.items():
        monkeypatch.setenv(key, value)
    args = _autoscale_args("--model", tiny_llama_dir, "--tokenizer", tiny_llama_dir,
                           "--load-steps", "3s@2", "--random-input-len", "16",
                           "--random-output-len", "4", "--max-total-tokens", "4096",
                           "--output-dir", str(tmp_path), "--startup-timeout", "600",
                           "--disable-tqdm")
    config = autoscale.fleet_configs(args, "unified")["unified-fixed"]
    config["engine"]["dtype"] = "float32"
    summary = autoscale.run_fleet("unified-fixed", config, args.load_steps, args,
                                  datasets.load_tokenizer(tiny_llama_dir))
    assert summary["num_requests"] == len(load_steps.step_arrivals(args.load_steps, 1)) > 0
    assert summary["completed"] == summary["num_requests"]
    assert summary["max_workers"] == 1 and summary["decisions"] == {"unified:up": 0,
                                                                    "unified:down": 0}
    assert summary["worker_seconds"] == pytest.approx(summary["trace_s"])
    assert summary["metrics_scrape_failures"] == 0
    assert all(s["states"].get("ready") == 1 for s in summary["fleet_timeline"])
    assert (tmp_path / "unified-fixed.yaml").exists() and summary["startup_s"] > 0
    with pytest.raises(httpx.ConnectError):  # stopped
        httpx.get(f"{summary['url']}/health", timeout=5)
