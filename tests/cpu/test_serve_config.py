"""ServeConfig: YAML + overrides, defaults, and errors that name the field."""

import pytest

from radixray.cluster.config import ConfigError, ServeConfig
from radixray.serve.builder import resolve_config
from radixray.serve.serve_cli import config_from_args, run_argv  # noqa: F401 - import check

DEFAULT_YAML = "configs/serve/default.yaml"


def test_default_yaml_is_valid_and_matches_defaults():
    cfg = ServeConfig.load(DEFAULT_YAML)
    assert cfg.engine.model == "default" and cfg.server.port == 8000
    assert cfg.server.served_model_name == "default"
    assert cfg.engine.engine_options()["chunked_prefill_size"] == 2048


def test_overrides_and_served_name():
    cfg = ServeConfig.load(DEFAULT_YAML, {"engine": {"model": "/models/Qwen3-0.6B/"},
                                          "server": {"port": 9000}})
    assert cfg.server.port == 9000 and cfg.server.served_model_name == "Qwen3-0.6B"
    assert resolve_config({"config_file": DEFAULT_YAML, "server": {"port": 9001}}).server.port == 9001


@pytest.mark.parametrize("data,needle", [
    ({"engine": {"chunked_prefill_size": "big"}}, "engine.chunked_prefill_size"),
    ({"engine": {"mem_fraction_static": 1.5}}, "engine.mem_fraction_static"),
    ({"server": {"port": 70000}}, "server.port"),
    ({"server": {"prot": 1}}, "server.prot"),
    ({"server": {"ingress": "sideways"}}, "server.ingress"),
    ({"engine": {"schedule_policy": "random"}}, "engine.schedule_policy"),
    ({"engine": {"quantization": "int4"}}, "engine.quantization"),
    ({"engine": {"device": "tpu"}}, "engine.device"),
    ({"engine": {"device": "cuda"}}, "server.worker_num_gpus"),
])
def test_errors_name_the_field(data, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        ServeConfig.parse(data)


def test_cuda_engine_with_a_gpu_per_worker():
    cfg = ServeConfig.parse({"engine": {"device": "cuda:0"}, "server": {"worker_num_gpus": 1}})
    assert cfg.engine.engine_options()["device"] == "cuda:0"
    assert cfg.fleet_key() != ServeConfig.parse({}).fleet_key()
    gpu = ServeConfig.load("configs/serve/gpu.yaml")
    assert gpu.engine.engine_options()["device"] == "cuda" and gpu.server.worker_num_gpus == 1


def test_cli_flags_override_yaml(tmp_path):
    import argparse

    from radixray.serve import serve_cli
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--config", DEFAULT_YAML, "--port", "8123",
                              "--disable-radix-cache", "--max-running-requests", "7"])
    cfg = config_from_args(args)
    assert cfg.server.port == 8123 and cfg.engine.disable_radix_cache
    assert cfg.engine.max_running_requests == 7 and cfg.engine.chunked_prefill_size == 2048
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  max_total_tokens: -3\n")
    assert serve_cli.cmd_serve(parser.parse_args(["serve", "--config", str(bad)])) == 2


def test_fleet_key_follows_the_fleet_shape_only():
    base = ServeConfig.parse({})
    same = ServeConfig.parse({"server": {"port": 9100, "ingress_replicas": 3}})
    assert same.controller_name() == base.controller_name()  # HTTP-side change: same fleet
    for change in ({"engine": {"max_total_tokens": 1000}}, {"fleet": {"workers": 2}},
                   {"router": {"policy": "round_robin"}}, {"server": {"worker_num_cpus": 2}}):
        assert ServeConfig.parse(change).controller_name() != base.controller_name(), change
    assert base.router_name().endswith(base.fleet_key())


def test_fleet_and_router_sections_validate_with_field_names():
    with pytest.raises(ConfigError, match="fleet.workers"):
        ServeConfig.parse({"fleet": {"workers": 0}})
    with pytest.raises(ConfigError, match="router.policy"):
        ServeConfig.parse({"router": {"policy": "nearest"}})
    assert ServeConfig.parse({"router": {"balance_abs_threshold": 2}}).router.settings() \
        .balance_abs_threshold == 2
