"""An autoscaled fleet on a local Ray (tiny Llama, min 1 max 2 workers): a burst of
concurrent requests adds a worker (in a placement group of its own), the decision is
logged and counted in /metrics; once the load falls the added worker is drained away
while it still has requests in flight, which finish; its placement group is released,
and no request gets a 5xx.

Every wait is on a condition (the fleet's state, the metrics), with generous deadlines.
"""

import glob
import os
import threading
import time

import httpx
import pytest
from serving_helpers import free_port, metric, served, tiny_config

pytestmark = pytest.mark.slow

DEADLINE_S = 300.0


def _config(model_dir: str) -> dict:
    cfg = tiny_config(model_dir, free_port(), worker_num_cpus=0.5)
    cfg["fleet"] = {"workers": 1, "health_check_interval_s": 0.5, "autoscaling": {
        "min_workers": 1, "max_workers": 2, "target_ongoing_requests": 4,
        "upscale_delay_s": 0, "downscale_delay_s": 2, "look_back_period_s": 1,
        "decision_interval_s": 0.5}}
    return cfg


def _fleet(base: str) -> dict:
    return httpx.get(f"{base}/fleet", timeout=60).json()


def _wait(what: str, check, deadline_s: float = DEADLINE_S):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"not within {deadline_s:.0f} s: {what}")


class Load:
    """Client threads that send requests until stopped; every status is kept."""

    def __init__(self):
        self.stop = threading.Event()
        self.statuses: list[int] = []
        self.threads: list[threading.Thread] = []

    def start(self, n: int, send) -> None:
        for i in range(n):
            t = threading.Thread(target=self._loop, args=(send, i), daemon=True)
            t.start()
            self.threads.append(t)

    def _loop(self, send, i: int) -> None:
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                self.statuses.append(send(client, i))

    def finish(self) -> list[int]:
        self.stop.set()
        for t in self.threads:
            t.join(180)
        assert not any(t.is_alive() for t in self.threads)
        return self.statuses


def _session_on(base: str, worker: str) -> str:
    """A session id the router has pinned to ``worker`` (sessions stick to their first
    pick, so one short request per fresh id until one lands there)."""
    for i in range(200):
        r = httpx.post(f"{base}/generate", headers={"X-Session-Id": f"s{i}"}, json={
            "text": "hello", "sampling_params": {"max_new_tokens": 1}}, timeout=120)
        assert r.status_code == 200, r.text
        if r.json()["meta_info"]["worker_id"] == worker:
            return f"s{i}"
    raise AssertionError(f"no session landed on {worker}")


def _controller_log_lines(pattern: str) -> list[str]:
    import ray
    logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
    out = []
    for path in glob.glob(os.path.join(logs, "worker-*")):
        with open(path, errors="replace") as f:
            out += [line for line in f if pattern in line]
    return out


def test_a_burst_adds_a_worker_and_the_lull_drains_it_away(tiny_llama_dir):
    with served(_config(tiny_llama_dir)) as base:
        import ray
        assert [w["worker_id"] for w in _fleet(base)["workers"]] == ["worker-0"]
        burst, trickle = Load(), Load()
        burst.start(16, lambda c, i: c.post(f"{base}/v1/completions", json={
            "model": "tiny", "prompt": f"burst {i}", "max_tokens": 64,
            "ignore_eos": True}).status_code)
        try:
            _wait("a second worker ready", lambda: [
                w for w in _fleet(base)["workers"]
                if w["worker_id"] == "worker-1" and w["state"] == "ready"])
            # While the burst keeps the fleet above its target, pin a trickle of longer
            # requests to the new worker: it has requests in flight whenever it is drained.
            session, trickled_on = _session_on(base, "worker-1"), []

            def trickle_one(c, i):
                r = c.post(f"{base}/generate", headers={"X-Session-Id": session}, json={
                    "text": f"trickle {i}", "sampling_params": {"max_new_tokens": 1000,
                                                                "ignore_eos": True}})
                if r.status_code == 200:
                    trickled_on.append(r.json()["meta_info"]["worker_id"])
                return r.status_code
            trickle.start(3, trickle_one)
            _wait("trickle requests running on worker-1", lambda: any(
                w["worker_id"] == "worker-1" and w["load"].get("inflight", 0) >= 2
                for w in _fleet(base)["workers"]))
        finally:
            statuses = burst.finish()
        try:
            removal = _wait("worker-1 drained away", lambda: [
                r for r in _fleet(base)["autoscaling"]["removals"]
                if r["worker_id"] == "worker-1" and r["seconds"] is not None])[0]
        finally:
            statuses += trickle.finish()
        assert statuses and all(s == 200 for s in statuses), sorted(set(statuses))
        assert removal["inflight_at_drain"] >= 1 and removal["aborted"] == 0
        state = _fleet(base)
        assert [(w["worker_id"], w["state"]) for w in state["workers"]] == [("worker-0", "ready")]
        decisions = state["autoscaling"]["decisions"]
        up = next(d for d in decisions if d["direction"] == "up")
        assert (up["current"], up["desired"]) == (1, 2)
        assert up["inputs"]["ongoing_requests"]["needs"] > 1
        assert any(d["direction"] == "down" and d["desired"] == 1 for d in decisions)

        def settled(page: str) -> bool:
            return metric(page, "radixray:autoscaling_decisions_total", role="unified",
                          direction="down") >= 1 and all(metric(
                              page, f"radixray:autoscaling_{kind}_workers", role="unified") == 1
                              for kind in ("current", "desired"))
        page = _wait("the metrics page: a down decision, 1 worker desired and current",
                     lambda: (lambda t: t if settled(t) else None)(
                         httpx.get(f"{base}/metrics", timeout=60).text))
        assert metric(page, "radixray:autoscaling_decisions_total", role="unified",
                      direction="up") >= 1
        # the added worker served the trickle until it left; then worker-0 took it over
        assert "worker-1" in trickled_on
        assert "worker-0" in trickled_on[trickled_on.index("worker-1"):]

        # each worker had its own placement group; the drained one's is gone
        groups = {g["name"]: g["state"] for g in ray.util.placement_group_table().values()}
        mine = {"-".join(n.split("-")[-2:]): s for n, s in groups.items()
                if "-controller-" in n}
        assert mine == {"worker-0": "CREATED", "worker-1": "REMOVED"}, groups
        # the decisions are in the controller's log with their inputs
        logged = _wait("the decisions in the controller's log",
                       lambda: _controller_log_lines("autoscaling unified: "))
        assert any("up 1 -> 2" in line and "ongoing_requests=" in line for line in logged)
        assert any("down 2 -> 1" in line for line in logged)
        # the fleet keeps serving on its one worker
        r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "after",
                                                       "max_tokens": 4}, timeout=120)
        assert r.status_code == 200
