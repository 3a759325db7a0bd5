"""Validate KubeRay manifests against the CRDs' OpenAPI v3 schemas (vendored in
tests/data/kuberay/, taken from ../shared/kuberay-crds: KubeRay commit feeaf72f).

Kubernetes prunes unknown fields silently, so the schemas do not forbid them; here every
object that lists its properties is closed (unless it preserves unknown fields), so a
misspelt field fails a test instead of vanishing at deploy time.
"""

from __future__ import annotations

import functools
import gzip
import json
import pathlib

import jsonschema

DATA = pathlib.Path(__file__).parent / "data" / "kuberay"


def _strict(node):
    if isinstance(node, list):
        return [_strict(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _strict(v) for k, v in node.items()}
    if node.pop("x-kubernetes-int-or-string", False):
        node.pop("type", None)
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.pop("nullable", False) and "type" in node:
        node["type"] = [node["type"], "null"]
    preserve = node.get("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in node and "additionalProperties" not in node and not preserve:
        node["additionalProperties"] = False
    return node


@functools.cache
def validator(kind: str) -> jsonschema.Draft7Validator:
    """The closed schema of ``kind`` (loaded once; the CRD schema itself is trusted)."""
    with gzip.open(DATA / f"{kind.lower()}.schema.json.gz", "rt") as f:
        data = json.load(f)
    return jsonschema.Draft7Validator(_strict(data["schema"]))


def validate(doc: dict) -> None:
    """Raise jsonschema.ValidationError (with the path) unless ``doc`` fits its kind's CRD."""
    kind = doc.get("kind")
    if kind not in ("RayCluster", "RayJob", "RayService"):
        raise ValueError(f"not a KubeRay resource: kind {kind!r}")
    if doc.get("apiVersion") != "ray.io/v1":
        raise ValueError(f"{kind}: apiVersion must be ray.io/v1, got {doc.get('apiVersion')!r}")
    error = jsonschema.exceptions.best_match(validator(kind).iter_errors(doc))
    if error is not None:
        raise error
