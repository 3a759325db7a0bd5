"""Every YAML file under configs/ passes radixray's schema: native serve configs, Ray Serve
deploy files (each application's args) and GRPO configs."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from radixray.cluster.config import ServeConfig
from radixray.rl.config import GRPOConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
FILES = sorted((ROOT / "configs").rglob("*.yaml"))


def test_configs_exist():
    names = {p.relative_to(ROOT / "configs").as_posix() for p in FILES}
    assert {"serve/default.yaml", "serve/fleet.yaml", "serve/pd.yaml", "serve/gpu.yaml",
            "serve/serve_app.yaml", "rl/grpo_smollm2.yaml"} <= names


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_config_passes_the_schema(path):
    data = yaml.safe_load(path.read_text())
    if "applications" in data:  # a Ray Serve deploy file
        for app in data["applications"]:
            assert app["import_path"] == "radixray:build_app"
            ServeConfig.parse(app.get("args") or {})
    elif path.parent.name == "rl":
        GRPOConfig.load(str(path))
    else:
        ServeConfig.load(str(path))
