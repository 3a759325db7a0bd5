"""A prefill-decode fleet under backpressure (tiny Llama, 1 prefill + 1 decode worker,
``server.max_queued_requests`` 2): requests the prefill worker refuses with 503
queue_full were already accepted by the decode worker, which reserved a room for each;
the dispatcher aborts them there, so the decode worker ends with nothing in flight and
its slots do not fill up with rooms no prefill will ever write (which stalled the pair
until ``disaggregation_waiting_timeout_s``). The refusals are made by holding the prefill
worker paused in place; every wait is on a condition."""

import threading
import time

import httpx
import pytest
from serving_helpers import free_port, served, tiny_config

from radixray.cluster.config import ServeConfig

pytestmark = pytest.mark.slow

DEADLINE_S = 120.0
BOUND, SENT = 2, 6


def _wait(what: str, check):
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S:.0f} s: {what}"
        time.sleep(0.2)


def test_requests_the_prefill_worker_refuses_leave_no_room_on_the_decode_worker(
        tiny_llama_dir):
    config = tiny_config(tiny_llama_dir, free_port(), worker_num_cpus=0.5,
                         max_queued_requests=BOUND)
    config["fleet"] = {"prefill_workers": 1, "decode_workers": 1}
    with served(config) as base:
        import ray
        cfg = ServeConfig.parse(config)

        def workers() -> dict:
            state = httpx.get(f"{base}/fleet", timeout=60).json()
            return {w["role"]: w for w in state["workers"]}
        prefill = ray.get_actor(cfg.worker_name(workers()["prefill"]["worker_id"]),
                                namespace=cfg.namespace)
        statuses: list[int] = []

        def send(i: int) -> int:
            r = httpx.post(f"{base}/v1/completions", json={
                "model": "tiny", "prompt": f"request {i} " * 8, "max_tokens": 4,
                "ignore_eos": True}, timeout=DEADLINE_S)
            statuses.append(r.status_code)
            return r.status_code
        ray.get(prefill.pause_generation.remote("in_place"))
        held = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(BOUND)]
        try:
            for t in held:  # these fill the paused prefill worker's queue to its bound
                t.start()
            _wait("the prefill queue at its bound",
                  lambda: workers()["prefill"]["load"]["inflight"] == BOUND)
            # one at a time, so each finds the queue full: refused after the decode worker
            # had taken it
            assert [send(i) for i in range(BOUND, SENT)] == [503] * (SENT - BOUND)
        finally:
            ray.get(prefill.continue_generation.remote())
        for t in held:
            t.join(DEADLINE_S)
        assert sorted(statuses) == [200] * BOUND + [503] * (SENT - BOUND)
        _wait("the decode worker has nothing in flight",
              lambda: workers()["decode"]["load"]["inflight"] == 0)
        pd = workers()["decode"]["load"]["pd"]["counts"]
        assert not any(pd.values()), pd
        r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "after",
                                                       "max_tokens": 4}, timeout=DEADLINE_S)
        assert r.status_code == 200, r.text
