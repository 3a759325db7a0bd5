"""Expert parallelism served: `radixray serve --model <tiny Qwen3-MoE> --ep-size 2
--ep-num-redundant-experts 2 --enable-eplb` starts one worker as a group of two rank
actors (torch.distributed among them, each with half of the expert slots, copies
included, and its own requests). Greedy tokens equal Hugging Face's through /generate on
either rank, also after `POST /fleet/eplb/rebalance` moved experts between the ranks for
a skewed load; a weight update from disk writes every copy on both ranks (greedy equals HF on the new
weights); a rank killed mid-run takes its group down, the controller restarts the group
as a unit, and the fleet serves again with every KV slot accounted for.
"""

import os
import signal
import subprocess
import time

import httpx
import pytest
import torch
from model_fixtures import assert_greedy_equal, hf_greedy, random_prompts
from serving_helpers import free_port, start_radixray_serve, wait_ready

NEW_TOKENS = 8
RESTART_DEADLINE_S = 120.0
_LAST_MODEL: list[str] = []  # the folder of the last weight update, if one ran


@pytest.fixture(scope="module")
def ep_server(tiny_qwen3_moe_dir, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("ep") / "serve.log"
    log = open(log_path, "w")
    proc = start_radixray_serve(tiny_qwen3_moe_dir, port, log, "--ep-size", "2",
                                "--ep-num-redundant-experts", "2", "--enable-eplb",
                                "--eplb-rebalance-num-iterations", "0")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, timeout=300)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _fleet(base: str) -> dict:
    r = httpx.get(f"{base}/fleet", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _post(base: str, path: str) -> None:
    r = httpx.post(base + path, timeout=60)
    assert r.status_code == 200, r.text


def _generate(base: str, prompt: list[int]) -> dict:
    r = httpx.post(f"{base}/generate", timeout=120, json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def _assert_each_rank_equals_hf(base: str, hf, prompts) -> None:
    for rank, other in (("worker-0", "worker-1"), ("worker-1", "worker-0")):
        _post(base, f"/fleet/workers/{other}/drain")  # the other rank still joins every step
        for prompt in prompts:
            out = _generate(base, prompt)
            assert out["meta_info"]["worker_id"] == rank
            ref, gaps = hf_greedy(hf, prompt, NEW_TOKENS)
            assert_greedy_equal(out["output_ids"], ref, gaps, f"{rank} prompt {len(prompt)}")
        _post(base, f"/fleet/workers/{other}/resume")


def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_ep2_served_greedy_equals_hf_on_both_ranks(ep_server, tiny_qwen3_moe_dir):
    state = _fleet(ep_server)
    assert state["ep_size"] == 2 and [w["state"] for w in state["workers"]] == ["ready"] * 2
    hf = _hf(tiny_qwen3_moe_dir)
    _assert_each_rank_equals_hf(ep_server, hf, random_prompts(hf.config.vocab_size)[:3])
    prompt = random_prompts(hf.config.vocab_size)[0]  # as SGLang's field, top-level
    r = httpx.post(f"{ep_server}/generate", timeout=120, json={
        "input_ids": prompt, "return_routed_experts": True,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert len(meta["routed_experts"]) == (len(prompt) + len(out["output_ids"]) - 1
                                           - meta["routed_experts_start"])


def test_a_served_rebalance_moves_experts_between_ranks(ep_server, tiny_qwen3_moe_dir):
    for rank, other in (("worker-0", "worker-1"), ("worker-1", "worker-0")):
        _post(ep_server, f"/fleet/workers/{other}/drain")  # a skewed load on each rank
        for token in (5, 250, 300):
            assert _generate(ep_server, [token] * 40)["meta_info"]["worker_id"] == rank
        _post(ep_server, f"/fleet/workers/{other}/resume")
    r = httpx.post(f"{ep_server}/fleet/eplb/rebalance", timeout=300)
    assert r.status_code == 200, r.text
    reports = r.json()
    reports = reports.get("workers", reports)
    assert sorted(reports) == ["worker-0", "worker-1"], reports
    first = [rep for rep in reports.values() if rep["applied"]]
    assert first, reports  # the group's rebalance (a rank asked later may find no better)
    rep = first[0]
    assert rep["ranks"] == 2 and rep["balancedness_after"] > rep["balancedness_before"]
    assert sum(x["received"] for x in reports.values()) > 0, reports
    hf = _hf(tiny_qwen3_moe_dir)
    _assert_each_rank_equals_hf(ep_server, hf, random_prompts(hf.config.vocab_size)[7:9])


@pytest.mark.slow  # out of the default run's 15-minute budget: make test-slow
def test_a_weight_update_writes_every_expert_copy_on_every_rank(ep_server, tmp_path):
    from model_fixtures import build_tiny_model
    new_dir = build_tiny_model("qwen3_moe", str(tmp_path / "new"), seed=1)
    _LAST_MODEL.append(new_dir)
    r = httpx.post(f"{ep_server}/update_weights_from_disk", json={"model_path": new_dir},
                   timeout=300)
    assert r.status_code == 200 and r.json()["success"], r.text
    hf = _hf(new_dir)
    _assert_each_rank_equals_hf(ep_server, hf, random_prompts(hf.config.vocab_size)[5:7])


def test_a_killed_rank_restarts_its_group_as_a_unit(ep_server, tiny_qwen3_moe_dir):
    before = {w["worker_id"]: w for w in _fleet(ep_server)["workers"]}
    os.kill(before["worker-1"]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + RESTART_DEADLINE_S
    while True:
        workers = {w["worker_id"]: w for w in _fleet(ep_server)["workers"]}
        if all(w["state"] == "ready" and w["generation"] == before[i]["generation"] + 1
               for i, w in workers.items()):
            break
        assert time.monotonic() < deadline, workers
        time.sleep(0.5)
    assert workers["worker-1"]["restarts"] == 1 and "died" in workers["worker-1"]["error"]
    # worker-0 either saw its collectives break first or was taken down with its group
    assert "expert-parallel group" in workers["worker-0"]["error"]
    assert workers["worker-0"]["pid"] != before["worker-0"]["pid"]  # restarted with it
    # the restarted ranks replayed the last update (from disk) before taking requests
    assert all(w["weight_version"] == before[i]["weight_version"] for i, w in workers.items())
    hf = _hf(_LAST_MODEL[0] if _LAST_MODEL else tiny_qwen3_moe_dir)
    _assert_each_rank_equals_hf(ep_server, hf, random_prompts(hf.config.vocab_size)[3:5])
    kv = httpx.get(f"{ep_server}/debug/kv_conservation", timeout=60)
    assert kv.status_code == 200, kv.text
    assert all(w["free"] + w["cached"] == w["pool"] for w in kv.json().values()), kv.json()
