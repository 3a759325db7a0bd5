"""docs/api.md names every HTTP route and every request field the ingress reads."""

import dataclasses
import inspect
import os
import re

from pydantic import BaseModel

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "api.md")
SKIP_ROUTES = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


def _doc() -> str:
    with open(DOC, encoding="utf-8") as f:
        return f.read()


def _backticked(doc: str) -> set[str]:
    """Every backticked span, and every identifier inside one (``a.b`` gives ``a`` and ``b``)."""
    spans = re.findall(r"`([^`]+)`", doc)
    words = {w for s in spans for w in re.findall(r"[A-Za-z_]\w*", s)}
    return set(spans) | words


def test_every_route_is_documented():
    from radixray.serve.ingress import app
    doc = _doc()
    missing = []
    for route in app.routes:
        path = getattr(route, "path", None)
        if path is None or path in SKIP_ROUTES:
            continue
        for method in sorted(getattr(route, "methods", None) or ()):
            if method in ("HEAD", "OPTIONS"):
                continue
            if f"`{method} {path}`" not in doc:
                missing.append(f"{method} {path}")
    assert not missing, f"docs/api.md lacks these routes (as `METHOD /path`): {missing}"


def test_every_request_field_is_documented():
    from radixray.engine.sampling import SamplingParams
    from radixray.serve import protocol
    names = _backticked(_doc())
    missing = []
    for model_name, model in inspect.getmembers(protocol, inspect.isclass):
        if not issubclass(model, BaseModel) or model.__module__ != protocol.__name__:
            continue
        for name, info in model.model_fields.items():
            shown = info.alias or name
            if shown not in names:
                missing.append(f"{model_name}.{shown}")
    for f in dataclasses.fields(SamplingParams):
        if f.name not in names:
            missing.append(f"sampling_params.{f.name}")
    assert not missing, f"docs/api.md lacks these request fields (in backticks): {missing}"
