"""A fleet of two engine workers on a local Ray cluster: the controller, the router's
policies, draining one worker, and a worker killed under load.

One app serves the whole module (two tiny-Llama workers, one CPU each); the
tests switch the routing policy through the admin endpoint and flush the caches
between workloads.
"""

import asyncio
import time

import httpx
import pytest
from serving_helpers import free_port, metric, served, tiny_config

from radixray.engine.faults import FailWeightUpdate, FaultInjector

USERS, TURNS = 8, 4
RESTART_DEADLINE_S = 30.0
OWNER_TIMEOUT_S = 25.0  # longer than Serve takes to replace a dead replica (~10-15 s)
CONFIG: dict = {}


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir):
    CONFIG.update(tiny_config(tiny_llama_dir, free_port()))
    CONFIG["fleet"] = {"workers": 2, "health_check_interval_s": 0.5,
                       "owner_timeout_s": OWNER_TIMEOUT_S}
    CONFIG["router"] = {"retry_backoff_s": 0.05}
    with served(CONFIG) as base:
        yield base


def _controller():
    from radixray.cluster.config import ServeConfig
    from radixray.serve.fleet import find_controller
    return find_controller(ServeConfig.parse(CONFIG))


def _admin(base: str, path: str, body=None) -> dict:
    r = httpx.post(base + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json() if r.headers.get("content-type", "").startswith("application/json") else {}


def _cold(base: str, policy: str) -> None:
    _admin(base, "/fleet/router", {"policy": policy})
    assert httpx.post(f"{base}/flush_cache", timeout=60).status_code == 200


def _state(base: str) -> dict:
    return httpx.get(f"{base}/fleet", timeout=60).json()


def _wait_idle(base: str) -> None:
    """Until no worker runs or queues a request (aborts land asynchronously)."""
    for _ in range(200):
        kv = httpx.get(f"{base}/debug/kv_conservation", timeout=60)
        assert kv.status_code == 200, kv.text  # every live worker's invariant holds
        if all(w["running"] == 0 and w["waiting"] == 0 for w in kv.json().values()):
            return
        time.sleep(0.1)
    raise AssertionError(f"workers still busy: {kv.json()}")


async def _conversation(client, user: int, session: bool) -> list[tuple[int, int, int]]:
    """TURNS chat turns of one user; (previous prompt tokens, cached tokens, prompt tokens)."""
    messages = [{"role": "system", "content": f"You are assistant number {user} of {USERS}. "
                 + " ".join(f"fact {user}-{i}" for i in range(12))}]
    headers = {"X-Session-Id": f"user-{user}"} if session else None
    out, prev_prompt = [], 0
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"turn {turn} of user {user}: "
                         + " ".join(f"word{user * 31 + turn * 7 + i}" for i in range(10))})
        r = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=6, temperature=0, extra_headers=headers)
        usage = r.usage
        out.append((prev_prompt, usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens))
        prev_prompt = usage.prompt_tokens
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    return out


def _coverage(turns: list[list[tuple[int, int, int]]]) -> list[float]:
    """cached tokens / the previous turn's prompt, for every turn after the first."""
    return [cached / prev for user in turns for prev, cached, _ in user[1:]]


def _run_users(base: str, concurrent: bool) -> list[list[tuple[int, int, int]]]:
    from openai import AsyncOpenAI

    async def main():
        client = AsyncOpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0)
        if concurrent:
            return await asyncio.gather(*(_conversation(client, u, False) for u in range(USERS)))
        return [await _conversation(client, u, False) for u in range(USERS)]
    return asyncio.run(main())


def test_cache_aware_keeps_each_conversation_on_one_worker(fleet):
    _cold(fleet, "cache_aware")
    before = httpx.get(f"{fleet}/metrics").text
    turns = _run_users(fleet, concurrent=True)
    cover = _coverage(turns)
    assert min(cover) >= 0.9, cover
    after = httpx.get(f"{fleet}/metrics").text
    routed = {w: metric(after, "radixray:router_requests_total", worker=w)
              - metric(before, "radixray:router_requests_total", worker=w)
              for w in ("worker-0", "worker-1")}
    assert sum(routed.values()) == USERS * TURNS and min(routed.values()) > 0, routed
    assert metric(after, "radixray:router_decisions_total", reason="cache_match") - metric(
        before, "radixray:router_decisions_total", reason="cache_match") >= USERS * (TURNS - 1)
    # Both workers' series are on the one page, with the fleet's.
    for w in ("worker-0", "worker-1"):
        assert metric(after, "radixray:generation_tokens_total", worker=w) > 0
    assert metric(after, "radixray:fleet_workers", state="ready") == 2
    assert metric(after, "radixray:router_tree_size_chars") > 0
    _wait_idle(fleet)


def test_round_robin_scatters_conversations(fleet):
    # One user at a time: round robin then alternates workers turn by turn, so turn t
    # lands where turn t-1 did not run, and only turn t-2's shorter history can match.
    _cold(fleet, "round_robin")
    cover = _coverage(_run_users(fleet, concurrent=False))
    assert max(cover) < 0.9, cover
    state = _state(fleet)["router"]
    assert state["policy"] == "round_robin" and state["decisions"].get("round_robin", 0) > 0
    _cold(fleet, "cache_aware")


def test_session_header_pins_a_conversation(fleet):
    _cold(fleet, "round_robin")
    workers = set()
    for i in range(4):
        r = httpx.post(f"{fleet}/generate", headers={"X-Session-Id": "pinned"}, json={
            "text": f"unrelated prompt number {i}", "sampling_params": {"max_new_tokens": 2}},
            timeout=60).json()
        workers.add(r["meta_info"]["worker_id"])
    assert len(workers) == 1  # affinity beats round robin
    assert _state(fleet)["router"]["decisions"].get("affinity") == 3
    _cold(fleet, "cache_aware")


def _stream_generate(base: str, text: str, max_new_tokens: int, results: list) -> None:
    """Stream /generate; append (status, last event or error, events)."""
    body = {"text": text, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
    events = []
    with httpx.stream("POST", f"{base}/generate", json=body, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            results.append((r.status_code, r.json(), events))
            return
        import json
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    results.append((200, events[-1] if events else None, events))


def _busy_worker(base: str, want: str | None = None) -> str:
    """A worker (``want``, if given) that holds an unfinished request (the worker's own
    count: the router counts a request from its pick, before the worker has it)."""
    import ray
    for _ in range(200):
        inflight = ray.get(_controller().inflight_rids.remote())
        busy = [w for w in sorted(inflight) if want in (None, w)]
        if busy:
            return busy[0]
        time.sleep(0.05)
    raise AssertionError("no worker took the request")


def test_drain_finishes_in_flight_and_routes_new_requests_elsewhere(fleet):
    import threading
    results: list = []
    # Paused in place, the worker holds the request without running it, so it is still in
    # flight when the drain is asked for, however fast or loaded the machine is.
    _admin(fleet, "/pause_generation", {"mode": "in_place"})
    t = threading.Thread(target=_stream_generate, args=(fleet, "a long story", 400, results))
    t.start()
    drained = _busy_worker(fleet)
    reply = _admin(fleet, f"/fleet/workers/{drained}/drain")
    _admin(fleet, "/continue_generation")
    assert reply["state"] == "draining" and reply["inflight"] == 1
    served = set()
    for i in range(4):
        r = httpx.post(f"{fleet}/generate", json={"text": f"a long story {i}",
                       "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert r.status_code == 200, r.text
        served.add(r.json()["meta_info"]["worker_id"])
    assert drained not in served
    t.join(120)
    status, last, _ = results[0]
    assert status == 200 and last["meta_info"]["completion_tokens"] == 400
    assert last["meta_info"]["worker_id"] == drained
    bad = httpx.post(f"{fleet}/fleet/workers/worker-9/drain", timeout=60)
    assert bad.status_code == 404 and "worker-9" in bad.json()["error"]["message"]
    assert _admin(fleet, f"/fleet/workers/{drained}/resume")["state"] == "ready"
    assert [w["state"] for w in _state(fleet)["workers"]] == ["ready", "ready"]
    _wait_idle(fleet)


def _versions(base: str) -> dict:
    r = httpx.get(f"{base}/get_weight_version", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _assert_serves(base: str, hf, prompts: list[list[int]], version: int) -> None:
    """Greedy /generate output equals ``hf``'s on every worker (each drained in turn)."""
    from model_fixtures import hf_greedy
    for worker, other in (("worker-0", "worker-1"), ("worker-1", "worker-0")):
        _admin(base, f"/fleet/workers/{other}/drain")
        for prompt in prompts:
            r = httpx.post(f"{base}/generate", json={"input_ids": prompt, "sampling_params": {
                "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}, timeout=60)
            assert r.status_code == 200, r.text
            meta = r.json()["meta_info"]
            assert meta["worker_id"] == worker and meta["weight_version"] == version
            assert r.json()["output_ids"] == hf_greedy(hf, prompt, 8)[0], f"{worker} {prompt}"
        _admin(base, f"/fleet/workers/{other}/resume")


def test_fleet_wide_weight_updates_are_all_or_none(fleet, tiny_llama_dir, tmp_path):
    """A tensor update through the controller's handle and a disk update over HTTP land on
    both workers with one version; a commit fault injected on one worker leaves both on
    the old weights; phases reach /metrics; memory release refuses unless paused."""
    import ray
    import torch
    from model_fixtures import random_prompts
    from transformers import AutoModelForCausalLM
    from weight_helpers import perturb

    from radixray.cluster.shared_weights import SharedWeightsWriter
    from radixray.cluster.weight_sources import TensorWeights
    controller = _controller()
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompts = random_prompts(hf.config.vocab_size)[3:5]
    assert _versions(fleet)["workers"] == {"worker-0": 0, "worker-1": 0}

    named = perturb(hf, seed=21)
    shared = SharedWeightsWriter(named, directory=str(tmp_path))
    result = ray.get(controller.update_weights.remote(TensorWeights(shared=shared.write(named))))
    shared.close()
    assert result["weight_version"] == 1 and result["workers"] == ["worker-0", "worker-1"]
    assert set(result["phases"]) == {"pause", "transfer", "load", "commit", "resume"}
    assert _versions(fleet) == {"weight_version": 1, "workers": {"worker-0": 1, "worker-1": 1}}
    _assert_serves(fleet, hf, prompts, 1)

    v1 = {n: p.clone() for n, p in hf.named_parameters()}
    perturb(hf, seed=22)
    hf.save_pretrained(tmp_path / "v2", safe_serialization=True)
    worker1 = ray.get(controller.worker.remote("worker-1")).handle
    ray.get(worker1.attach_fault_injector.remote(
        FaultInjector(FailWeightUpdate("commit"))))
    r = httpx.post(f"{fleet}/update_weights_from_disk", json={"model_path": str(tmp_path / "v2")},
                   timeout=120)
    assert r.status_code == 400 and "worker-1" in r.json()["error"]["message"], r.text
    assert _versions(fleet)["workers"] == {"worker-0": 1, "worker-1": 1}
    v2 = {n: p.clone() for n, p in hf.named_parameters()}
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.copy_(v1[n])
    _assert_serves(fleet, hf, prompts, 1)  # worker-0 committed, then rolled back

    bad = httpx.post(f"{fleet}/update_weights_from_disk", json={
        "model_path": str(tmp_path / "v2"), "weight_version": 1}, timeout=60)
    assert bad.status_code == 400 and "weight_version must be an integer greater than 1" in bad.text
    r = httpx.post(f"{fleet}/update_weights_from_disk", json={
        "model_path": str(tmp_path / "v2"), "weight_version": 4, "pause_mode": "abort",
        "release_memory": ["kv_cache"]}, timeout=120)
    assert r.status_code == 200 and r.json()["weight_version"] == 4, r.text
    assert "release" in r.json()["phases"]
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.copy_(v2[n])
    _assert_serves(fleet, hf, prompts, 4)
    page = httpx.get(f"{fleet}/metrics").text
    assert metric(page, "radixray:weight_version", worker="worker-1") == 4
    assert metric(page, "radixray:weight_updates_total", result="failed") == 1
    assert metric(page, "radixray:weight_update_phase_seconds_count", phase="load") == 3
    assert {w["worker_id"]: w["weight_version"] for w in _state(fleet)["workers"]} == {
        "worker-0": 4, "worker-1": 4}

    refused = httpx.post(f"{fleet}/release_memory_occupation", json={"tags": ["kv_cache"]})
    assert refused.status_code == 400 and "pause_generation" in refused.text
    _admin(fleet, "/pause_generation", {"mode": "retract"})
    released = _admin(fleet, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
    assert all(v["bytes"] > 0 for v in released.values())
    stuck = httpx.post(f"{fleet}/continue_generation", timeout=60)
    assert stuck.status_code == 400 and "resume_memory_occupation" in stuck.text
    _admin(fleet, "/resume_memory_occupation", {})
    _admin(fleet, "/continue_generation")
    _assert_serves(fleet, hf, prompts, 4)
    _wait_idle(fleet)


def test_string_weight_versions_over_http(fleet, tiny_llama_dir, tmp_path):
    """SGLang's RL clients send step tags: an update from disk as "v1" is stamped on GET
    /get_weight_version, /metrics (an info label) and /generate's meta_info; ints keep
    their order after a label; a refused version is a 400 naming weight_version that
    changes nothing, and the next valid call succeeds (the same label again included);
    POST /update_weight_version renames the weights serving."""
    import torch
    from model_fixtures import random_prompts
    from transformers import AutoModelForCausalLM
    from weight_helpers import perturb
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompts = random_prompts(hf.config.vocab_size)[5:6]
    s1 = {n: p.clone() for n, p in perturb(hf, seed=31).items()}
    hf.save_pretrained(tmp_path / "s1", safe_serialization=True)
    perturb(hf, seed=32)
    hf.save_pretrained(tmp_path / "s2", safe_serialization=True)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.copy_(s1[n])
    start = _versions(fleet)["weight_version"]
    assert isinstance(start, int)

    def update(path: str, version) -> httpx.Response:
        return httpx.post(f"{fleet}/update_weights_from_disk", json={
            "model_path": str(tmp_path / path), "weight_version": version}, timeout=120)

    r = update("s1", "v1")
    assert r.status_code == 200 and r.json()["weight_version"] == "v1", r.text
    assert _versions(fleet) == {"weight_version": "v1",
                                "workers": {"worker-0": "v1", "worker-1": "v1"}}
    page = httpx.get(f"{fleet}/metrics").text
    assert metric(page, "radixray:weight_version_info", worker="worker-1", weight_version="v1") == 1
    assert "radixray:weight_version{" not in page  # no number while a label serves
    r = update("s2", start + 1)
    assert r.status_code == 200 and r.json()["weight_version"] == start + 1, r.text
    for refused in (start + 1, 1):
        bad = update("s1", refused)
        assert bad.status_code == 400, bad.text
        assert f"weight_version must be an integer greater than {start + 1}" in bad.text
    bad = update("s1", "")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "weight_version", bad.text
    assert _versions(fleet)["workers"] == {"worker-0": start + 1, "worker-1": start + 1}
    for _ in range(2):  # a label may repeat, as SGLang's clients send it on every bucket
        r = update("s1", "v1")
        assert r.status_code == 200 and r.json()["weight_version"] == "v1", r.text
    rename = httpx.post(f"{fleet}/update_weight_version", json={"new_version": start + 1})
    assert rename.status_code == 400 and "greater than" in rename.text, rename.text
    rename = httpx.post(f"{fleet}/update_weight_version", json={"new_version": "v1-final",
                                                                "abort_all_requests": True})
    assert rename.status_code == 400, rename.text
    assert rename.json()["error"]["param"] == "abort_all_requests"
    rename = httpx.post(f"{fleet}/update_weight_version", json={"new_version": "v1-final"})
    assert rename.status_code == 200 and rename.json()["new_version"] == "v1-final", rename.text
    assert _versions(fleet) == {"weight_version": "v1-final",
                                "workers": {"worker-0": "v1-final", "worker-1": "v1-final"}}
    _assert_serves(fleet, hf, prompts, "v1-final")
    _wait_idle(fleet)


def test_killed_worker_is_restarted_and_requests_end_cleanly(fleet):
    import threading

    import ray
    controller = _controller()
    results: list = []
    # Texts that share no prefix: cache_aware spreads them by load over both workers.
    texts = ["alpha load", "bravo load", "charlie load", "delta load", "echo load", "fox load"]
    threads = [threading.Thread(target=_stream_generate, args=(fleet, text, 900, results))
               for text in texts]
    for t in threads:
        t.start()
    _busy_worker(fleet, "worker-1")
    victim = ray.get(controller.worker.remote("worker-1"))
    ray.kill(victim.handle, no_restart=True)
    killed_at = time.monotonic()
    for t in threads:
        t.join(120)
    assert len(results) == 6
    for status, last, events in results:
        if status != 200:  # not placed anywhere: an OpenAI-style 503
            assert status == 503 and last["error"]["code"] == "worker_unavailable"
        elif "error" in last:  # cut mid-stream: an explicit error event, never silence
            assert last["error"]["type"] == "server_error" and len(events) >= 1
        else:
            assert last["meta_info"]["completion_tokens"] == 900
    assert any(status == 200 and "error" not in last for status, last, _ in results)
    # The controller notices, restarts the worker in its slot, and the fleet serves again.
    while time.monotonic() - killed_at < RESTART_DEADLINE_S:
        workers = {w["worker_id"]: w for w in _state(fleet)["workers"]}
        if workers["worker-1"]["state"] == "ready" and workers["worker-1"]["generation"] == 1:
            break
        time.sleep(0.25)
    else:
        raise AssertionError(f"worker-1 not back within {RESTART_DEADLINE_S} s: {workers}")
    assert workers["worker-1"]["restarts"] == 1 and "died" in workers["worker-1"]["error"]
    # A restart loads the original weights; the last update (a disk one, when the weight
    # test ran before) is replayed on it before it takes requests.
    fleet_version = _versions(fleet)["weight_version"]
    assert workers["worker-1"]["weight_version"] == fleet_version
    _admin(fleet, "/fleet/workers/worker-0/drain")  # force the next request onto the new one
    r = httpx.post(f"{fleet}/generate", json={"text": "back again",
                   "sampling_params": {"max_new_tokens": 3}}, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["worker_id"] == "worker-1", r.text
    assert r.json()["meta_info"]["weight_version"] == fleet_version
    _admin(fleet, "/fleet/workers/worker-0/resume")
    _wait_idle(fleet)  # KV conservation on every live worker
    page = httpx.get(f"{fleet}/metrics").text
    assert metric(page, "radixray:worker_restarts_total", worker="worker-1") == 1


def test_fleet_survives_the_loss_of_an_ingress_replica(fleet):
    """The ingress replica dies; Serve replaces it and the new replica joins the same fleet:
    same controller, no worker restarted."""
    import ray
    from serving_helpers import wait_ready
    before = {w["worker_id"]: w["started_at"] for w in _state(fleet)["workers"]}
    controller_id = _controller()._actor_id
    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::radixray#Ingress")]
    assert len(replicas) == 1
    ray.kill(ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"]),
             no_restart=True)
    time.sleep(2.0)
    wait_ready(fleet, timeout=120)
    r = httpx.post(f"{fleet}/generate", json={"text": "still here",
                   "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200, r.text
    assert _controller()._actor_id == controller_id
    assert {w["worker_id"]: w["started_at"] for w in _state(fleet)["workers"]} == before
