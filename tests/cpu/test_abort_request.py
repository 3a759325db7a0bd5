"""Aborting requests: by id (a request and the choices derived from it) or all of them, in
the engine (``Engine.abort_request``) and over HTTP (``POST /abort_request``) on a 2-worker
fleet and on a prefill-decode fleet. An aborted request ends with finish reason ``abort``
and the output it had (a stream's last chunk, then ``[DONE]``; a 200 when not streaming),
nothing hangs, and every KV slot is free or cached afterwards.

No test races the generation: a request is aborted while generation is paused in place
(read its first chunk, pause, abort, continue), while it waits in the queue, or while its
KV transfer is held by a stalled sender, so it cannot finish on its own first.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time

import httpx
import pytest
from engine_helpers import GREEDY, in_thread, rand_ids, wait_until
from serving_helpers import free_port, served, tiny_config

from radixray.engine.request_ids import belongs_to, choice_rids

LONG = 3000  # tokens a request may generate: far more than it gets before its abort
ENGINE_LONG = 900  # the same for the in-process engine (the tiny model's 1024-token context)
CONFIG: dict = {}  # the running fleet's


# ---------------------------------------------------------------- ids and the engine verb
def test_choice_ids_derive_from_the_base_and_only_they_match_it():
    assert choice_rids("r", 1) == ["r"]
    assert choice_rids("r", 3) == ["r_0", "r_1", "r_2"]
    assert all(belongs_to(x, "r") for x in ["r", "r_0", "r_12"])
    assert not any(belongs_to(x, "r") for x in ["rr", "r_", "r_x", "r_1_2", "x_r", "q"])
    assert belongs_to("r_1_2", "r_1")  # a per-prompt id's own choices


def _running(rids: list[str], min_outputs: int = 1):
    return lambda s: all(any(r.rid == rid and len(r.output_ids) >= min_outputs
                             for r in s.queues.running) for rid in rids)


def test_engine_aborts_a_request_with_its_choices_then_everything(eng):
    """A batch given one id runs as id_0, id_1, ...; aborting the id ends all of them with
    their partial output, not a bystander whose id merely starts with it; abort_all ends the
    rest. Generation is paused in place meanwhile, so none can finish first."""
    vocab = eng.limits.vocab_size
    params = {**GREEDY, "max_new_tokens": ENGINE_LONG}
    batch, box = in_thread(eng.generate, input_ids=[rand_ids(vocab, 12, s) for s in (1, 2, 3)],
                           sampling_params=params, rid="grp")
    lookalike, box2 = in_thread(eng.generate, input_ids=rand_ids(vocab, 9, 4),
                                sampling_params=params, rid="grp_x")
    wait_until(eng, _running(["grp_0", "grp_1", "grp_2", "grp_x"]))
    assert eng.pause_generation("in_place") == 4
    try:
        assert sorted(eng.abort_request("grp")) == ["grp_0", "grp_1", "grp_2"]
        assert eng.abort_request("no-such-request") == []
        batch.join(30)
        assert not batch.is_alive()
        for out in box["out"]:
            meta = out["meta_info"]
            assert meta["finish_reason"]["type"] == "abort", meta
            assert 1 <= meta["completion_tokens"] == len(out["output_ids"]) < ENGINE_LONG
        assert lookalike.is_alive()  # "grp_x" is not a choice of "grp"
        assert eng.abort_request(abort_all=True) == ["grp_x"]
    finally:
        eng.continue_generation()
    lookalike.join(30)
    assert box2["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    kv = eng.check_kv_conservation()
    assert kv["running"] == kv["waiting"] == 0 and kv["free"] + kv["cached"] == kv["pool"]


def test_engine_abort_request_takes_exactly_one_of_rid_and_abort_all(eng):
    for kwargs in ({}, {"rid": "a", "abort_all": True}):
        with pytest.raises(ValueError, match="exactly one of rid or abort_all"):
            eng.abort_request(**kwargs)


# ---------------------------------------------------------------- HTTP helpers
def _post(base: str, path: str, body: dict | None = None, status: int = 200) -> dict:
    r = httpx.post(base + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json() if r.headers.get("content-type", "").startswith("application/json") else {}


def _events(lines) -> list:
    """The JSON events of SSE ``lines`` up to ``[DONE]`` (which must come)."""
    out = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return out
        out.append(json.loads(line[6:]))
    raise AssertionError(f"the stream ended without [DONE] after {out[-1:]}")


class Held:
    """Generation paused in place on every worker while the block runs (continued after),
    so the requests in flight cannot finish before the block aborts them."""

    def __init__(self, base: str, expect: int | None = None):
        self.base, self.expect = base, expect

    def __enter__(self):
        held = _post(self.base, "/pause_generation", {"mode": "in_place"})["requests"]
        if self.expect is not None and sum(held.values()) < self.expect:
            kv = httpx.get(f"{self.base}/debug/kv_conservation", timeout=60).json()
            _post(self.base, "/continue_generation")  # the next test gets a running fleet
            raise AssertionError(f"{self.expect} requests should be held, not {held}: {kv}")
        return held

    def __exit__(self, *exc):
        _post(self.base, "/continue_generation")


def _wait_clean(base: str) -> dict:
    """Until no worker holds a request; every worker's slot check holds and every slot is
    free or cached."""
    for _ in range(300):
        kv = httpx.get(f"{base}/debug/kv_conservation", timeout=60)
        assert kv.status_code == 200, kv.text
        workers = kv.json()
        if all(w["running"] == 0 and w["waiting"] == 0 and w["free"] + w["cached"] == w["pool"]
               for w in workers.values()):
            return workers
        time.sleep(0.1)
    raise AssertionError(f"requests or slots still held: {workers}")


def _wait_waiting(base: str, n: int) -> None:
    """Until ``n`` requests wait in the workers' queues (generation is paused)."""
    for _ in range(300):
        workers = httpx.get(f"{base}/debug/kv_conservation", timeout=60).json()
        if sum(w["waiting"] for w in workers.values()) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"{n} requests never reached a queue: {workers}")


def _native_stream_aborted_by_rid(base: str, rid: str) -> dict:
    """A native /generate stream with ``rid``: first chunk, abort it by id, read to the end.
    Returns the abort's answer after checking the stream ended with abort and its output."""
    body = {"text": "the cat sat on", "stream": True, "rid": rid,
            "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True, "temperature": 0}}
    with httpx.stream("POST", f"{base}/generate", json=body, timeout=120) as s:
        assert s.status_code == 200, s.read()
        lines = s.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["output_ids"]
        with Held(base, expect=1):
            answer = _post(base, "/abort_request", {"rid": rid})
        events = _events(lines)
    last = events[-1]
    meta = last["meta_info"]
    assert meta["id"] == rid and meta["finish_reason"]["type"] == "abort", meta
    assert 1 <= meta["completion_tokens"] == len(last["output_ids"]) < LONG
    assert answer["aborted"] == 1 and answer["rids"] == [rid], answer
    return answer


async def _long_native_streams(base: str, n: int, abort) -> list[dict]:
    """``n`` concurrent long native streams, queued while generation is paused and started
    together; once each streamed its first chunk, ``abort()`` runs (generation held in
    place); then each stream is read to its end. The last event of each."""
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(i: int, started: asyncio.Event, go: asyncio.Event) -> dict:
            body = {"text": f"request {i}: " + "word " * (3 + i), "stream": True,
                    "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
            async with client.stream("POST", f"{base}/generate", json=body) as s:
                assert s.status_code == 200, await s.aread()
                lines = s.aiter_lines()
                async for line in lines:
                    if line.startswith("data: "):
                        break
                started.set()
                await go.wait()
                return _events([line async for line in lines])[-1]
        started = [asyncio.Event() for _ in range(n)]
        go = asyncio.Event()
        _post(base, "/pause_generation", {"mode": "in_place"})
        try:
            tasks = [asyncio.create_task(one(i, started[i], go)) for i in range(n)]
            await asyncio.to_thread(_wait_waiting, base, n)
        finally:
            _post(base, "/continue_generation")
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        await asyncio.to_thread(abort)
        go.set()
        return await asyncio.wait_for(asyncio.gather(*tasks), 120)


def _abort_all_under_load(base: str, n: int, workers=("worker-0", "worker-1")) -> dict:
    """``n`` long streams aborted at once by ``abort_all``; every forward pass of
    ``workers`` takes 10 ms meanwhile, so none can finish its LONG tokens before the abort
    (on a fast path the tiny model could, while the client still waits for the last
    stream's first chunk)."""
    import ray

    from radixray.engine.faults import FaultInjector, SlowForwards
    answers: dict = {}

    def abort() -> None:
        with Held(base, expect=n):
            answers.update(_post(base, "/abort_request", {"abort_all": True}))
    handles = [_worker_handle(w) for w in workers]
    ray.get([h.attach_fault_injector.remote(FaultInjector(SlowForwards(0.01))) for h in handles])
    try:
        lasts = asyncio.run(_long_native_streams(base, n, abort))
    finally:
        ray.get([h.attach_fault_injector.remote(None) for h in handles])
    for last in lasts:
        meta = last["meta_info"]
        assert meta["finish_reason"]["type"] == "abort", meta
        assert 1 <= meta["completion_tokens"] < LONG
    assert answers["aborted"] == n, answers
    assert sorted(answers["rids"]) == sorted(last["meta_info"]["id"] for last in lasts)
    return answers


@pytest.fixture(scope="module")
def long_llama_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with an 8192-token context, so a request can ask for LONG tokens."""
    folder = tmp_path_factory.mktemp("long_llama")
    shutil.copytree(tiny_llama_dir, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="class")
def base(request, long_llama_dir):
    """The test class's fleet (its FLEET and ROUTER sections) of the long-context tiny
    Llama; its URL."""
    config = tiny_config(long_llama_dir, free_port())
    config["engine"]["max_total_tokens"] = 6 * LONG  # a decode worker reserves every LONG
    config["fleet"], config["router"] = request.cls.FLEET, request.cls.ROUTER
    CONFIG.clear()
    CONFIG.update(config)
    with served(config) as url:
        yield url


# ---------------------------------------------------------------- a 2-worker fleet
@pytest.mark.slow
class TestTwoWorkerFleet:
    FLEET = {"workers": 2}
    ROUTER = {"policy": "round_robin"}

    def test_bad_bodies_are_400_naming_the_field(self, base):
        for body, param in (({}, "rid"), ({"rid": "a", "abort_all": True}, "abort_all"),
                            ({"rid": ""}, "rid"), ({"rid": "a", "force": 1}, "force")):
            error = _post(base, "/abort_request", body, status=400)["error"]
            assert error["param"] == param, (body, error)

    def test_unknown_rid_aborts_nothing_and_is_a_200(self, base):
        answer = _post(base, "/abort_request", {"rid": "never-sent"})
        assert answer == {"success": True, "aborted": 0, "rids": [],
                          "workers": {"worker-0": 0, "worker-1": 0}}

    def test_native_stream_aborted_by_rid(self, base):
        _native_stream_aborted_by_rid(base, "native-abc")
        _wait_clean(base)

    def test_openai_stream_with_n_2_aborted_by_its_header_rid(self, base):
        """The X-Request-Id header names the request; both choices (rid_0, rid_1) end with
        abort through the official client; the id and the header carry the rid."""
        from openai import OpenAI
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "count"}], n=2, stream=True,
            max_tokens=LONG, extra_body={"ignore_eos": True},
            extra_headers={"X-Request-Id": "chat-7"})
        assert stream.response.headers["x-request-id"] == "chat-7"
        content = {0: "", 1: ""}
        reasons = {}
        chunks = iter(stream)
        while not all(content.values()):  # both choices have streamed some text
            chunk = next(chunks)
            for c in chunk.choices:
                content[c.index] += c.delta.content or ""
        with Held(base, expect=2):
            answer = _post(base, "/abort_request", {"rid": "chat-7"})
        for chunk in chunks:
            assert chunk.id == "chatcmpl-chat-7"
            for c in chunk.choices:
                content[c.index] += c.delta.content or ""
                if c.finish_reason is not None:
                    reasons[c.index] = c.finish_reason
        assert reasons == {0: "abort", 1: "abort"}
        assert answer["rids"] == ["chat-7_0", "chat-7_1"], answer
        assert all(content.values())
        _wait_clean(base)

    def test_non_streaming_completion_aborted_while_queued_is_a_200(self, base):
        """Aborted in the queue (generation paused): 200, finish_reason abort, no tokens;
        the rid from the body is in the id."""
        out: dict = {}

        def send() -> None:
            out["r"] = httpx.post(f"{base}/v1/completions", json={
                "model": "tiny", "prompt": "hello", "max_tokens": LONG, "ignore_eos": True,
                "rid": "cmpl-body-1"}, timeout=120)
        with Held(base):
            t = threading.Thread(target=send)
            t.start()
            _wait_waiting(base, 1)
            answer = _post(base, "/abort_request", {"rid": "cmpl-body-1"})
        t.join(60)
        assert not t.is_alive()
        r = out["r"]
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"] == "cmpl-cmpl-body-1"
        assert body["choices"][0]["finish_reason"] == "abort"
        assert body["usage"]["completion_tokens"] == 0
        assert answer["aborted"] == 1
        _wait_clean(base)

    def test_a_rid_in_flight_is_refused(self, base):
        with Held(base):
            t = threading.Thread(target=lambda: httpx.post(f"{base}/generate", json={
                "text": "hi", "rid": "dup", "sampling_params": {"max_new_tokens": 4}},
                timeout=120))
            t.start()
            _wait_waiting(base, 1)
            again = httpx.post(f"{base}/generate", json={"text": "hi", "rid": "dup"},
                               timeout=60)
            assert again.status_code == 400 and "dup" in again.text, again.text
            _post(base, "/abort_request", {"rid": "dup"})
        t.join(60)

    def test_the_body_rid_wins_over_the_header_and_a_header_alone_names_the_request(self, base):
        both = httpx.post(f"{base}/v1/completions", json={
            "prompt": "a", "max_tokens": 1, "rid": "from-body"},
            headers={"X-Request-Id": "from-header"}, timeout=60)
        assert both.status_code == 200 and both.json()["id"] == "cmpl-from-body"
        alone = httpx.post(f"{base}/generate", json={"text": ["a", "b"], "sampling_params": {
            "max_new_tokens": 1}}, headers={"X-Request-Id": "hdr"}, timeout=60)
        assert [o["meta_info"]["id"] for o in alone.json()] == ["hdr_0", "hdr_1"]
        assert alone.headers["x-request-id"] == "hdr"
        fresh = httpx.post(f"{base}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, timeout=60)
        rid = fresh.headers["x-request-id"]  # made up by Serve's proxy or the ingress
        assert rid and fresh.json()["id"] == f"chatcmpl-{rid}"

    def test_abort_all_under_load_on_both_workers(self, base):
        answer = _abort_all_under_load(base, 6)
        assert answer["workers"] == {"worker-0": 3, "worker-1": 3}, answer  # round robin
        _wait_clean(base)


# ---------------------------------------------------------------- a prefill-decode fleet
@pytest.mark.slow
class TestPrefillDecodeFleet:
    FLEET = {"prefill_workers": 1, "decode_workers": 1}
    ROUTER: dict = {}

    def test_native_stream_aborted_by_rid(self, base):
        answer = _native_stream_aborted_by_rid(base, "pd-native")
        assert answer["workers"]["worker-1"] == 1  # the decode half streams it
        _pd_clean(base)

    def test_abort_all_under_load(self, base):
        answer = _abort_all_under_load(base, 4)
        assert answer["workers"]["worker-1"] == 4, answer
        _pd_clean(base)

    def test_abort_while_the_kv_is_in_flight_frees_both_halves(self, base):
        """The prefill sender stalls before the room's last write: the request is aborted
        on both halves (one id), its client gets a 200 with finish reason abort, and once the
        stalled write ends both workers hold no slot and no room."""
        import ray

        from radixray.engine.faults import FaultInjector, StallKVSend
        prefill, decode = _worker_handle("worker-0"), _worker_handle("worker-1")
        ray.get(prefill.attach_fault_injector.remote(FaultInjector(StallKVSend(5.0))))
        out: dict = {}

        def send() -> None:
            out["r"] = httpx.post(f"{base}/generate", json={
                "text": "a short prompt", "rid": "in-flight",
                "sampling_params": {"max_new_tokens": 8}}, timeout=120)
        t = threading.Thread(target=send)
        t.start()
        try:
            while not ray.get(prefill.pd_status.remote())["stalled"]:
                time.sleep(0.02)
            assert ray.get(decode.pd_status.remote())["transfer"] == 1  # KV awaited
            answer = _post(base, "/abort_request", {"rid": "in-flight"})
            t.join(60)
        finally:
            ray.get(prefill.attach_fault_injector.remote(None))
        assert not t.is_alive()
        r = out["r"]
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert answer["aborted"] == 1 and answer["rids"] == ["in-flight"], answer
        # the decode half, and the prefill half unless the decode half's cancel reached it first
        assert answer["workers"]["worker-1"] == 1 and answer["workers"]["worker-0"] in (0, 1)
        _pd_clean(base)


def _worker_handle(worker: str):
    import ray

    from radixray.cluster.config import ServeConfig
    from radixray.serve.fleet import find_controller
    controller = find_controller(ServeConfig.parse(CONFIG))
    return ray.get(controller.worker.remote(worker)).handle


def _pd_clean(base: str) -> None:
    """Both halves hold no request, no room and no slot (besides the cache)."""
    import ray
    _wait_clean(base)
    for worker in ("worker-0", "worker-1"):
        handle = _worker_handle(worker)
        for _ in range(300):
            if ray.get(handle.pd_status.remote())["rooms"] == 0:
                break
            time.sleep(0.1)
        assert ray.get(handle.pd_status.remote())["rooms"] == 0, worker
    _wait_clean(base)
