"""LoRA through the served app: two workers, adapters made here with peft.

``/v1/models`` lists the adapters (``parent``: the model); OpenAI ``model`` picks one as
``<model>:<adapter>`` or by its name, native ``/generate`` by ``lora_path``, and greedy
tokens equal Hugging Face's with the adapter merged; ``/load_lora_adapter`` and
``/unload_lora_adapter`` change every worker (a load one worker refuses changes none);
an unknown adapter is a 400 naming it; the router sends an adapter's requests to the worker
that already runs it, and learns which workers hold an adapter from the workers' own reports
(a restarted router too); ``/update_weights_from_disk`` with ``lora_name`` updates one adapter on
every worker through weight-update sessions, under the adapter's own version.
"""

import time

import httpx
import pytest
from model_fixtures import assert_greedy_equal, hf_greedy, merged_hf
from serving_helpers import free_port, metric, served, tiny_config

NEW_TOKENS = 8
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


CONFIG: dict = {}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, lora_adapters):
    CONFIG.update(tiny_config(tiny_llama_dir, free_port()))
    CONFIG["engine"].update(lora_paths=[f"alpha={lora_adapters['alpha']}"], max_lora_rank=4,
                            max_loras_per_batch=2)
    CONFIG["fleet"] = {"workers": 2}
    with served(CONFIG) as base:
        yield base
        kv = httpx.get(f"{base}/debug/kv_conservation", timeout=60).json()
        assert all(w["running"] == 0 and w["waiting"] == 0 for w in kv.values())


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def _generate(base: str, ids: list[int], lora_path=None) -> dict:
    r = httpx.post(f"{base}/generate", json={"input_ids": ids, "sampling_params": GREEDY,
                                             "lora_path": lora_path}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _models(base: str) -> dict:
    return {m["id"]: m for m in httpx.get(f"{base}/v1/models", timeout=60).json()["data"]}


def test_adapters_are_listed_loaded_and_unloaded_on_every_worker(server, lora_adapters):
    models = _models(server)
    assert models["tiny"]["parent"] is None and models["alpha"]["parent"] == "tiny"
    assert models["alpha"]["root"] == lora_adapters["alpha"]
    # rank 8 above max_lora_rank=4: every worker refuses, and the fleet is unchanged
    r = httpx.post(f"{server}/load_lora_adapter",
                   json={"lora_name": "beta", "lora_path": lora_adapters["beta"]}, timeout=120)
    assert r.status_code == 400 and "max_lora_rank=4" in r.json()["error"]["message"]
    assert "beta" not in _models(server)
    r = httpx.post(f"{server}/load_lora_adapter",
                   json={"lora_name": "alpha2", "lora_path": lora_adapters["alpha"]}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["workers"] == ["worker-0", "worker-1"]
    assert _models(server)["alpha2"]["parent"] == "tiny"
    r = httpx.post(f"{server}/update_lora_adapter", json={
        "lora_name": "alpha2", "lora_path": lora_adapters["alpha"], "lora_version": "v2"},
        timeout=120)
    assert r.status_code == 200, r.text
    assert (r.json()["workers"], r.json()["lora_version"]) == (["worker-0", "worker-1"], "v2")
    meta = _generate(server, [4, 5, 6], "alpha2")["meta_info"]
    assert (meta["lora_path"], meta["lora_version"]) == ("alpha2", "v2")
    r = httpx.post(f"{server}/unload_lora_adapter", json={"lora_name": "alpha2"}, timeout=120)
    assert r.status_code == 200, r.text
    assert "alpha2" not in _models(server)
    r = httpx.post(f"{server}/unload_lora_adapter", json={"lora_name": "alpha2"}, timeout=120)
    assert r.status_code == 400 and "'alpha2'" in r.json()["error"]["message"]


def test_greedy_tokens_through_every_api_equal_hf_with_the_adapter_merged(
        server, client, tiny_llama_dir, lora_adapters):
    ids = [5, 17, 33, 2, 90, 41, 7, 64, 12]
    ref, gaps = hf_greedy(merged_hf(tiny_llama_dir, lora_adapters["alpha"]), ids, NEW_TOKENS)
    native = _generate(server, ids, "alpha")
    assert_greedy_equal(native["output_ids"], ref, gaps, "native lora_path")
    base = _generate(server, ids)
    assert base["output_ids"] != native["output_ids"]
    prompt = "the cat sat on the mat"
    texts = set()
    for model in ("tiny:alpha", "alpha"):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS,
                                        temperature=0)
        texts.add(out.choices[0].text)
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW_TOKENS,
                                      temperature=0)
    assert len(texts) == 1 and plain.choices[0].text not in texts
    chat = client.chat.completions.create(model="tiny:alpha", max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": prompt}])
    assert chat.choices[0].message.content is not None


def test_an_unknown_adapter_is_a_400_naming_it(server, client):
    import openai
    for model in ("tiny:gamma", "gamma"):
        with pytest.raises(openai.BadRequestError, match="gamma") as err:
            client.completions.create(model=model, prompt="hi", max_tokens=2)
        assert err.value.status_code == 400
    r = httpx.post(f"{server}/generate", json={"text": "hi", "lora_path": "gamma"}, timeout=60)
    assert r.status_code == 400
    body = r.json()["error"]
    assert "unknown LoRA adapter 'gamma'" in body["message"] and body["param"] == "lora_path"


def test_the_router_sends_an_adapters_requests_to_the_worker_running_it(server):
    httpx.post(f"{server}/flush_cache", timeout=60)
    workers = {_generate(server, [3 + i, 50 + 7 * i, 9, 200 - i], "alpha")["meta_info"]
               ["worker_id"] for i in range(6)}
    assert len(workers) == 1, workers  # distinct prompts: no prefix affinity to follow
    ids = [240, 8, 9, 10, 11, 12, 13]  # no earlier request starts with 240
    first = _generate(server, ids, "alpha")["meta_info"]
    again = _generate(server, ids, "alpha")["meta_info"]
    assert first["cached_tokens"] == 0 and again["cached_tokens"] == len(ids) - 1
    assert again["worker_id"] in workers


def _router_adapters(base: str) -> dict[str, list[str]]:
    """Each routable worker's adapters as the router has them ({} while it restarts)."""
    r = httpx.get(f"{base}/fleet", timeout=60)
    router = r.json().get("router") if r.status_code == 200 else None
    return {w: s["adapters"] for w, s in (router or {}).get("workers", {}).items()}


def _wait_for_adapters(base: str, check, what: str) -> dict[str, list[str]]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        held = _router_adapters(base)
        if check(held):
            return held
        time.sleep(0.2)
    raise AssertionError(f"{what} within 120 s: the router has {held}")


def test_the_router_learns_which_workers_hold_an_adapter_from_the_workers(server,
                                                                        lora_adapters):
    import ray

    from radixray.cluster.config import ServeConfig
    # a fresh alpha everywhere (unload empties its slots), then run on worker-1 only
    for verb, body in (("unload", {"lora_name": "alpha"}),
                       ("load", {"lora_name": "alpha", "lora_path": lora_adapters["alpha"]})):
        r = httpx.post(f"{server}/{verb}_lora_adapter", json=body, timeout=120)
        assert r.status_code == 200, r.text
    _wait_for_adapters(server, lambda h: not any(h.values()), "no worker reporting alpha")
    _on_worker(server, "worker-1", [33, 44, 55], "alpha")
    # the router restarts with no memory of its picks; the workers' reports tell it
    cfg = ServeConfig.parse(CONFIG)
    ray.kill(ray.get_actor(cfg.router_name(), namespace=cfg.namespace), no_restart=False)
    held = _wait_for_adapters(
        server, lambda h: len(h) == 2 and "alpha" in h.get("worker-1", ()),
        "the restarted router learning that worker-1 holds alpha")
    assert "alpha" not in held["worker-0"]
    for i in range(4):  # distinct prompts: nothing but the adapter to follow
        meta = _generate(server, [100 + i, 7 * i + 1, 9], "alpha")["meta_info"]
        assert meta["worker_id"] == "worker-1"


def _on_worker(base: str, worker: str, ids: list[int], lora_path=None) -> dict:
    """Generate on ``worker``: the other one drains meanwhile."""
    other = "worker-1" if worker == "worker-0" else "worker-0"
    assert httpx.post(f"{base}/fleet/workers/{other}/drain", timeout=60).status_code == 200
    try:
        out = _generate(base, ids, lora_path)
    finally:
        assert httpx.post(f"{base}/fleet/workers/{other}/resume", timeout=60).status_code == 200
    assert out["meta_info"]["worker_id"] == worker
    return out


def test_an_adapter_update_session_from_disk_reaches_every_worker(server, lora_adapters,
                                                                  tmp_path):
    from safetensors.torch import load_file, save_file
    ids = [7, 91, 23, 5, 60, 18, 3]
    old = load_file(f"{lora_adapters['alpha']}/adapter_model.safetensors")
    save_file({n: 3 * t for n, t in old.items() if ".lora_B." in n},
              str(tmp_path / "delta.safetensors"))  # some of alpha's tensors
    before = {w: (_on_worker(server, w, ids), _on_worker(server, w, ids, "alpha"))
              for w in ("worker-0", "worker-1")}

    def counts():
        page = httpx.get(f"{server}/metrics", timeout=60).text
        return (metric(page, "radixray:weight_updates_total", result="ok", target="adapter"),
                metric(page, "radixray:weight_update_phase_seconds_count", phase="commit",
                       target="adapter"),
                metric(page, "radixray:weight_updates_total", target="model"))
    counted = counts()
    r = httpx.post(f"{server}/update_weights_from_disk", json={
        "model_path": str(tmp_path / "delta.safetensors"), "lora_name": "alpha",
        "weight_version": "rl-3", "pause_mode": None}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["lora_name"], body["lora_version"], body["workers"]) == (
        "alpha", "rl-3", ["worker-0", "worker-1"])
    assert httpx.get(f"{server}/get_weight_version", timeout=60).json()["weight_version"] == 0
    updated = set()
    for w, (base, alpha) in before.items():
        assert _on_worker(server, w, ids)["output_ids"] == base["output_ids"]
        out = _on_worker(server, w, ids, "alpha")
        assert out["meta_info"]["lora_version"] == "rl-3"
        assert out["output_ids"] != alpha["output_ids"]
        updated.add(tuple(out["output_ids"]))
    assert len(updated) == 1  # the same new weights on both workers
    r = httpx.post(f"{server}/update_weights_from_disk", json={
        "model_path": lora_adapters["alpha"], "lora_name": "gamma"}, timeout=120)
    assert r.status_code == 400 and "unknown LoRA adapter 'gamma'" in r.text
    # the whole adapter again from its folder: the next int version, the first weights
    r = httpx.post(f"{server}/update_weights_from_disk", json={
        "model_path": lora_adapters["alpha"], "lora_name": "alpha"}, timeout=120)
    assert r.status_code == 200 and r.json()["lora_version"] == 1, r.text
    for w, (_, alpha) in before.items():
        assert _on_worker(server, w, ids, "alpha")["output_ids"] == alpha["output_ids"]
    # both adapter updates are in the fleet's weight-update metrics, apart from the model's
    ok, commits, model = counts()
    assert (ok - counted[0], commits - counted[1], model - counted[2]) == (2, 2, 0)
