"""The serving fleet across two Ray nodes (tests/two_node.py: 127.0.0.1 and 127.0.0.2):
two workers placed one per node by a STRICT_SPREAD placement group, each reporting its own
node's address in /fleet, and the router spreading requests over both; then a
prefill-decode pair split over the two nodes, whose KV crosses between the nodes'
transfer engines (each listening on its own node's address), giving the tokens of one
unified engine; an expert-parallel group and a tensor-parallel group with one rank per
node; a GRPO trainer on the
other node from its worker; and node 2 lost under load (every request ends, the worker
moves to the head). Each test gets a cluster of its own."""

from __future__ import annotations

import httpx
import pytest
from serving_helpers import free_port, metric, serve_app, tiny_config
from two_node import HEAD_IP, NODE2_IP, two_node_cluster

from radixray import Engine

pytestmark = pytest.mark.slow
PROMPTS = [f"request {i} about the two nodes" for i in range(8)]


@pytest.fixture
def cluster():
    """A fresh cluster per test: a fleet's actors are detached and would outlive Serve."""
    with two_node_cluster(num_cpus=2) as c:
        yield c


def _greedy(base: str, prompt: str) -> str:
    r = httpx.post(f"{base}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _serve(config: dict) -> str:
    config["fleet"]["placement_strategy"] = "STRICT_SPREAD"
    return _serve_from_the_head(config)


def _serve_from_the_head(config: dict) -> str:
    """Serve with one HTTP proxy, the head's. Ray Serve's default puts a proxy on every
    node, and node 2's (listening on all addresses, with SO_REUSEPORT) would share the
    head's 127.0.0.1 port on this one machine: the kernel would hand it some of the
    test's connections, reset when node 2 is killed."""
    return serve_app(config, proxy_location="HeadOnly")


def _shutdown() -> None:
    from ray import serve
    serve.shutdown()


def _workers(base: str) -> list[dict]:
    r = httpx.get(f"{base}/fleet", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["workers"]


def _workers_when_reachable(base: str) -> list[dict] | None:
    """The fleet's workers, or None while /fleet answers 503 (the controller was on the
    lost node and is coming back from its checkpoint)."""
    r = httpx.get(f"{base}/fleet", timeout=60)
    if r.status_code == 503:
        return None
    assert r.status_code == 200, r.text
    return r.json()["workers"]


def test_workers_on_both_nodes_and_the_router_uses_both(cluster, tiny_llama_dir):
    cfg = tiny_config(tiny_llama_dir, free_port())
    cfg["fleet"] = {"workers": 2}
    cfg["router"] = {"policy": "round_robin"}
    base = _serve(cfg)
    try:
        workers = _workers(base)
        assert sorted(w["node_ip"] for w in workers) == [HEAD_IP, NODE2_IP]
        texts = [_greedy(base, p) for p in PROMPTS]
        page = httpx.get(f"{base}/metrics", timeout=60).text
        served = {w["worker_id"]: metric(page, "radixray:requests_total", worker=w["worker_id"])
                  for w in workers}
        assert all(n >= 2 for n in served.values()), served
        with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096) as eng:
            want = [eng.generate(p, {"temperature": 0, "max_new_tokens": 8,
                                     "ignore_eos": True})["text"] for p in PROMPTS]
        assert texts == want
    finally:
        _shutdown()


def test_prefill_and_decode_on_two_nodes_give_unified_tokens(cluster, tiny_llama_dir):
    cfg = tiny_config(tiny_llama_dir, free_port())
    cfg["fleet"] = {"prefill_workers": 1, "decode_workers": 1}
    base = _serve(cfg)
    try:
        workers = _workers(base)
        by_role = {w["role"]: w for w in workers}
        assert {by_role["prefill"]["node_ip"], by_role["decode"]["node_ip"]} == {HEAD_IP,
                                                                                NODE2_IP}
        for w in workers:  # each transfer engine listens on its own node's address
            assert w["kv_session"].startswith(w["node_ip"] + ":"), w
        texts = [_greedy(base, p) for p in PROMPTS[:4]]
        with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096) as eng:
            want = [eng.generate(p, {"temperature": 0, "max_new_tokens": 8,
                                     "ignore_eos": True})["text"] for p in PROMPTS[:4]]
        assert texts == want
    finally:
        _shutdown()


def test_an_expert_parallel_group_spans_both_nodes(cluster, tiny_qwen3_moe_dir):
    """ep_size 2, STRICT_SPREAD: one rank per node, joined by gloo over the nodes'
    addresses (the rendezvous is on the first rank's node); each rank's greedy output
    equals one engine's (HF-equal on its own: test_ep_engine.py)."""
    cfg = tiny_config(tiny_qwen3_moe_dir, free_port())
    cfg["engine"]["ep_size"] = 2
    cfg["fleet"] = {"workers": 1}
    base = _serve(cfg)
    try:
        workers = _workers(base)
        assert sorted(w["node_ip"] for w in workers) == [HEAD_IP, NODE2_IP]
        assert all(w["state"] == "ready" for w in workers)
        with Engine(model=tiny_qwen3_moe_dir, dtype="float32", max_total_tokens=4096) as eng:
            want = [eng.generate(p, {"temperature": 0, "max_new_tokens": 8,
                                     "ignore_eos": True})["text"] for p in PROMPTS[:4]]
        assert [_greedy(base, p) for p in PROMPTS[:4]] == want
    finally:
        _shutdown()


def test_a_tensor_parallel_group_spans_both_nodes(cluster, tiny_llama_dir):
    """tp_size 2, STRICT_SPREAD: the worker actor (rank 0) in its bundle on one node, its
    follower rank actor in the other bundle, on the other node; the collectives and the
    step channel cross between the nodes' addresses. Greedy = one TP 1 engine."""
    cfg = tiny_config(tiny_llama_dir, free_port())
    cfg["engine"]["tp_size"] = 2
    cfg["fleet"] = {"workers": 1}
    base = _serve(cfg)
    try:
        (worker,) = _workers(base)
        assert worker["state"] == "ready"
        ranks = worker["tp_ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        assert sorted(r["node_ip"] for r in ranks) == [HEAD_IP, NODE2_IP]
        assert ranks[0]["node_ip"] == worker["node_ip"]
        with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=4096) as eng:
            want = [eng.generate(p, {"temperature": 0, "max_new_tokens": 8,
                                     "ignore_eos": True})["text"] for p in PROMPTS[:4]]
        assert [_greedy(base, p) for p in PROMPTS[:4]] == want
    finally:
        _shutdown()


def _grpo_two_steps(model_dir: str, tmp_path, check, **options) -> tuple:
    """Build a GRPO job of two steps (``options`` over a tiny base config), run ``check(job)``
    before training, train; returns the job and its metric rows (two synced versions)."""
    import json

    from radixray.rl.config import GRPOConfig
    from radixray.rl.grpo import run
    from radixray.rl.job import Job
    cfg = GRPOConfig.parse({
        "model": model_dir, "task": "char_frequency", "steps": 2, "prompts_per_step": 4,
        "group_size": 4, "max_new_tokens": 8, "micro_batch_size": 16, "held_out_prompts": 2,
        "seed": 3, **options})
    job = Job(cfg)
    try:
        check(job)
    except BaseException:
        job.close()
        raise
    run(cfg, str(tmp_path), job=job)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["synced_version"] for r in rows] == [1, 2]
    return job, rows


def test_a_grpo_trainer_on_the_other_node_syncs_over_the_node_addresses(cluster,
                                                                        tiny_llama_dir,
                                                                        tmp_path):
    """placement: separate, STRICT_SPREAD: the trainer's bundle and the worker's land on two
    nodes; the weight-update group's rank 0 (the trainer) listens on its own node's address
    and each step's broadcast reaches the worker on the other node."""
    import ray

    def check(job) -> None:
        groups = [g for g in ray.util.placement_group_table().values()
                  if g["state"] == "CREATED" and g["name"].startswith("grpo-")]
        assert len(groups) == 1 and len(set(groups[0]["bundles_to_node_id"].values())) == 2
        trainer_node = groups[0]["bundles_to_node_id"][0]
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        assert ray.get(job.trainer.broadcast_address.remote())[0] == ips[trainer_node]
    _grpo_two_steps(tiny_llama_dir, tmp_path, check, placement="separate", fleet={
        "engine": {"dtype": "float32", "max_total_tokens": 4096},
        "fleet": {"workers": 1, "placement_strategy": "STRICT_SPREAD"}})


def test_losing_node2_under_load_ends_every_request_and_the_worker_moves(cluster,
                                                                         tiny_llama_dir):
    """Two workers (SPREAD: one per node), requests streaming; node 2's processes are
    killed. Every request ends, with its tokens or a clear error (none hangs); the
    controller restarts the lost worker where capacity remains (the head) and the fleet
    serves from both workers again."""
    import concurrent.futures
    import time

    cfg = tiny_config(tiny_llama_dir, free_port())
    cfg["fleet"] = {"workers": 2, "health_check_interval_s": 0.5, "max_restarts": 2}
    cfg["router"] = {"policy": "round_robin", "retry_backoff_s": 0.05}
    cfg["fleet"]["placement_strategy"] = "SPREAD"
    base = _serve_from_the_head(cfg)
    try:
        before = {w["worker_id"]: w["node_ip"] for w in _workers(base)}
        assert sorted(before.values()) == [HEAD_IP, NODE2_IP]
        (moved,) = [w for w, ip in before.items() if ip == NODE2_IP]

        def ask(i: int) -> int:
            r = httpx.post(f"{base}/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": f"load {i}", "max_tokens": 48, "ignore_eos": True})
            if r.status_code != 200 and r.text != "Internal Server Error":
                assert r.json()["error"]["message"], r.text
            # (Ray Serve's proxy answers a bare 500 for a request whose ingress replica
            # was itself on the lost node: that one never reaches radixray's handlers)
            return r.status_code

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(ask, i) for i in range(24)]
            time.sleep(1.0)
            killed_at = time.time()
            cluster.kill_node2()
            codes = [f.result(timeout=180) for f in futures]  # none hangs
        assert set(codes) <= {200, 500, 503} and codes.count(200) >= 1, codes
        deadline = time.monotonic() + 180
        while True:
            workers = _workers_when_reachable(base)
            if workers and all(w["state"] == "ready" for w in workers) and len(workers) == 2:
                break
            assert time.monotonic() < deadline, workers
            time.sleep(1.0)
        assert [w["node_ip"] for w in workers] == [HEAD_IP, HEAD_IP]
        # a new actor for the lost slot (the controller itself may have been on node 2 and
        # come back from its checkpoint, so the restart counter is not what to read)
        assert next(w for w in workers if w["worker_id"] == moved)["started_at"] > killed_at
        assert [_greedy(base, p) for p in PROMPTS[:2]]
    finally:
        _shutdown()


def test_colocated_grpo_reaches_a_worker_off_the_trainers_node(cluster, tiny_llama_dir,
                                                               tmp_path):
    """Colocated, two workers SPREAD over the nodes: the trainer's shared-memory file is
    read on its node, the other node's worker takes the same weights from the object store;
    both serve exactly the trainer's logprobs (deterministic) at every step."""
    import ray

    def check(job) -> None:
        state = ray.get(job.controller.fleet_state.remote())
        assert sorted(w["node_ip"] for w in state["workers"]) == [HEAD_IP, NODE2_IP]
    job, rows = _grpo_two_steps(tiny_llama_dir, tmp_path, check, deterministic=True, fleet={
        "engine": {"dtype": "float32", "max_total_tokens": 4096},
        "fleet": {"workers": 2, "placement_strategy": "SPREAD"}})
    assert all(r["logprob_abs_diff_max"] == 0.0 for r in rows), rows
    assert job._told_off_node  # one worker was off the trainer's node: the fallback ran
