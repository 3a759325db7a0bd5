"""A fleet started before its Serve app (serve/fleet.py ``prestart_fleet``, as ``radixray
serve`` and the tests' ``serve_app`` do): it loads without any ingress, the ingress that
Serve deploys next adopts it (same controller, its worker not restarted), and a fleet whose
app never comes up stops once its owner stops beating, releasing its actors."""

import time

import httpx
import pytest
from serving_helpers import free_port, start_local_ray, tiny_config, wait_ready

pytestmark = pytest.mark.slow  # two fleets and a Serve app: ~40 s

OWNER_TIMEOUT_S = 6.0
GONE_DEADLINE_S = 120.0  # an upper bound only: the stop comes OWNER_TIMEOUT_S after the last beat


def _config(model_dir: str, **engine) -> dict:
    config = tiny_config(model_dir, free_port())
    config["engine"].update(engine)
    config["fleet"] = {"workers": 1, "owner_timeout_s": OWNER_TIMEOUT_S}
    return config


def _fleet_actors(cfg) -> set[str]:
    """The named actors of ``cfg``'s fleet alive now (controller, router, workers)."""
    import ray
    key = cfg.fleet_key()
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"{cfg.app_name}-") and a["name"].endswith(key)}


def _start(cfg, owner: str):
    """Prestart ``cfg``'s fleet; wait until it is ready. Returns (heartbeat event, controller)."""
    import ray

    from radixray.serve.fleet import find_controller, prestart_fleet
    beats = prestart_fleet(cfg, owner)
    controller = find_controller(cfg)
    assert controller is not None
    info = ray.get(controller.start.remote(), timeout=300)  # the same start, shared
    assert info.context_len > 0
    return beats, controller


@pytest.fixture
def local_ray():
    import ray
    from ray import serve
    start_local_ray()
    yield
    serve.shutdown()
    ray.shutdown()


def test_prestarted_fleet_is_adopted_by_the_ingress_and_an_orphan_stops(tiny_llama_dir,
                                                                         local_ray):
    import ray
    from ray import serve

    from radixray import build_app
    from radixray.serve.builder import resolve_config
    config = _config(tiny_llama_dir)
    cfg = resolve_config(config)
    beats, controller = _start(cfg, "test-prestart")
    assert _fleet_actors(cfg) == {cfg.controller_name(), cfg.router_name(),
                                  cfg.worker_name("worker-0")}
    worker = ray.get_actor(cfg.worker_name("worker-0"), namespace=cfg.namespace)
    worker_id = worker._actor_id

    port = config["server"]["port"]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(config), name=cfg.app_name, route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base)
    beats.set()  # the ingress replica beats from here on
    r = httpx.post(f"{base}/generate", json={"text": "hello", "sampling_params": {
        "max_new_tokens": 3, "temperature": 0}}, timeout=60)
    assert r.status_code == 200, r.text
    # adopted, not replaced: one fleet, the same controller and worker actors
    assert _fleet_actors(cfg) == {cfg.controller_name(), cfg.router_name(),
                                  cfg.worker_name("worker-0")}
    from radixray.serve.fleet import find_controller
    assert find_controller(cfg)._actor_id == controller._actor_id
    assert ray.get_actor(cfg.worker_name("worker-0"),
                         namespace=cfg.namespace)._actor_id == worker_id

    # a fleet whose app never comes up: gone once its owner stops beating
    orphan = resolve_config(_config(tiny_llama_dir, max_total_tokens=2048))
    assert orphan.fleet_key() != cfg.fleet_key()
    orphan_beats, _ = _start(orphan, "test-orphan")
    orphan_beats.set()
    deadline = time.monotonic() + GONE_DEADLINE_S
    while _fleet_actors(orphan) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _fleet_actors(orphan), f"still alive: {_fleet_actors(orphan)}"
    # the served fleet is untouched
    r = httpx.post(f"{base}/generate", json={"text": "still here", "sampling_params": {
        "max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200, r.text
