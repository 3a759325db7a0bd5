"""Every manifest under k8s/ fits its KubeRay CRD (closed objects: a misspelt field fails
here), and the serving and job configs embedded in them pass radixray's schemas."""

from __future__ import annotations

import pathlib
import shlex

import pytest
import yaml
from kuberay_schema import validate

from radixray.cluster.config import ServeConfig
from radixray.rl.config import GRPOConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
MANIFESTS = sorted(p for p in (ROOT / "k8s").glob("*.yaml") if p.name != "kustomization.yaml")


def _docs(path: pathlib.Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_manifest_fits_its_crd(path):
    for doc in _docs(path):
        validate(doc)


def test_a_misspelt_field_is_caught():
    import jsonschema
    doc = _docs(ROOT / "k8s" / "rayservice.yaml")[0]
    doc["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    with pytest.raises(jsonschema.ValidationError, match="rayStartParam"):
        validate(doc)


def _pod_specs(spec: dict) -> list[dict]:
    cluster = spec.get("rayClusterConfig") or spec.get("rayClusterSpec") or spec
    groups = [cluster["headGroupSpec"]] + cluster.get("workerGroupSpecs", [])
    return [g["template"]["spec"] for g in groups]


def test_rayservice_serves_a_valid_config_and_drains():
    doc = _docs(ROOT / "k8s" / "rayservice.yaml")[0]
    serve_config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    for app in serve_config["applications"]:
        assert app["import_path"] == "radixray:build_app"
        cfg = ServeConfig.parse(app["args"])
        assert cfg.server.host == "0.0.0.0"  # reachable from the pod network
    head = _pod_specs(doc["spec"])[0]["containers"][0]
    assert head["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert head["livenessProbe"]["httpGet"]["path"] == "/health"
    for pod in _pod_specs(doc["spec"]):
        drain = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        timeout = float(drain[drain.index("--timeout") + 1])
        assert drain[:2] == ["radixray", "drain"]
        assert pod["terminationGracePeriodSeconds"] > timeout


def test_rayjob_runs_the_shipped_grpo_config():
    doc = _docs(ROOT / "k8s" / "rayjob-grpo.yaml")[0]
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "radixray.rl.grpo"]
    config = argv[argv.index("--config") + 1].replace("/opt/radixray/", "")
    GRPOConfig.load(str(ROOT / config))
    assert doc["spec"]["shutdownAfterJobFinishes"] is True


def test_the_gpu_tensor_parallel_job_fits_its_gpu_pod():
    """The GRPO RayJob on GPUs: its config passes radixray's schema, and the trainer's GPU
    plus one GPU bundle per rank of every tensor-parallel worker fit the one GPU pod."""
    doc = _docs(ROOT / "k8s" / "rayjob-grpo-gpu-tp.yaml")[0]
    argv = shlex.split(doc["spec"]["entrypoint"])
    cfg = GRPOConfig.load(str(ROOT / argv[argv.index("--config") + 1].replace(
        "/opt/radixray/", "")))
    serve = cfg.serve_config()
    assert serve.engine.tp_size > 1 and serve.engine.device == "cuda"
    assert cfg.placement == "separate" and serve.fleet.placement_strategy == "PACK"
    bundles = serve.worker_bundles()
    assert len(bundles) == serve.fleet.workers * serve.engine.tp_size
    gpus = 1 + sum(b.get("GPU", 0) for b in bundles)  # the trainer's GPU, then the ranks'
    (group,) = doc["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    pod = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert gpus <= float(group["rayStartParams"]["num-gpus"]) == float(pod["nvidia.com/gpu"])
    assert float(pod["cpu"]) >= 1 + sum(b.get("CPU", 0) for b in bundles)


def test_every_manifest_pins_the_ray_version_of_pyproject():
    import re
    pin = re.search(r'"ray\[serve\]==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    for path in MANIFESTS:
        for doc in _docs(path):
            spec = doc["spec"]
            cluster = spec.get("rayClusterConfig") or spec.get("rayClusterSpec") or spec
            assert cluster["rayVersion"] == pin, path.name


def test_the_gpu_tensor_parallel_service_gives_each_worker_a_pod_of_its_gpus():
    """Each tensor-parallel worker's bundles (tp_size of them, worker_num_gpus GPUs each, one
    per rank actor) fill one GPU pod exactly, so a PACK placement keeps a group's ranks on
    one node; and the config passes radixray's schema."""
    doc = _docs(ROOT / "k8s" / "rayservice-gpu-tp.yaml")[0]
    app = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]
    cfg = ServeConfig.parse(app["args"])
    assert cfg.engine.tp_size > 1 and cfg.engine.device == "cuda"
    cpus, gpus = (cfg.engine.tp_size * x for x in cfg.rank_resources())
    assert cfg.fleet.placement_strategy == "PACK"
    group = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    pod = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert float(group["rayStartParams"]["num-gpus"]) == float(pod["nvidia.com/gpu"]) == gpus
    assert float(pod["cpu"]) >= cpus
    assert group["replicas"] >= cfg.fleet.workers  # one pod per worker


def test_the_autoscaled_rayservice_can_grow_to_its_fleet_max():
    """Autoscaling on: KubeRay's in-tree autoscaler is enabled, the fleet's config passes the
    schema with fleet.autoscaling, and the worker group can grow to hold max_workers engine
    workers (each reserving worker_num_cpus of a pod's CPUs)."""
    doc = _docs(ROOT / "k8s" / "rayservice-autoscaling.yaml")[0]
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    app = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]
    cfg = ServeConfig.parse(app["args"])
    scaling = cfg.fleet.autoscaling
    assert scaling is not None and scaling.min_workers < scaling.max_workers
    assert cfg.worker_bundles() == []  # a placement group per engine worker
    (group,) = cluster["workerGroupSpecs"]
    pod_cpus = float(group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
    per_pod = int(pod_cpus // cfg.server.worker_num_cpus)
    assert per_pod >= 1
    assert group["minReplicas"] * per_pod <= scaling.min_workers
    assert group["maxReplicas"] * per_pod >= scaling.max_workers
