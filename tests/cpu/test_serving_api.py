"""The served app on a local Ray cluster, driven by the official openai client and httpx."""

import asyncio
import json
import time

import httpx
import pytest
from serving_helpers import (
    assert_disconnect_returns_kv,
    free_port,
    metric,
    served,
    tiny_config,
)

CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "the cat sat on the mat"}]
PROMPTS = ["the cat sat", "hello world, the quick brown fox", "a b c"]
QUEUE_BOUND = 24
PAUSE_ATTEMPTS = 5  # a 1,000-token request can finish before the pause reaches it on a fast host


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # SLO targets no run can miss: every finished request is goodput (the edges are unit-tested)
    # and a queue bound test_a_full_queue_is_refused_at_once_with_retry_after fills
    with served(tiny_config(tiny_llama_dir, free_port(), slo_ttft_s=3600.0,
                            slo_tpot_s=3600.0, max_queued_requests=QUEUE_BOUND)) as base:
        yield base
        kv = httpx.get(f"{base}/debug/kv_conservation", timeout=60).json()["worker-0"]
        assert kv["running"] == 0 and kv["waiting"] == 0


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_models_health_ready(server):
    models = httpx.get(f"{server}/v1/models", timeout=60).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    for path in ("/health", "/ready", "/health_generate"):
        assert httpx.get(server + path, timeout=60).status_code == 200, path
    assert httpx.post(f"{server}/flush_cache", timeout=60).status_code == 200


def test_completions_equal_in_process_engine(client, eng):
    for prompt in PROMPTS:
        want = eng.generate(prompt, {"max_new_tokens": 12, "temperature": 0})
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == want["text"]
        assert got.usage.completion_tokens == len(want["output_ids"])
        assert got.usage.prompt_tokens == want["meta_info"]["prompt_tokens"]
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want["text"]
        assert chunks[-1].usage.completion_tokens == len(want["output_ids"])


def test_chat_equal_in_process_engine(client, eng):
    ids = eng.apply_chat_template(CHAT)
    want = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 16, "temperature": 0})
    got = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=16, temperature=0)
    assert got.choices[0].message.content == want["text"]
    assert got.choices[0].finish_reason == want["meta_info"]["finish_reason"]["type"]
    assert got.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=16,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want["text"]


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    """vLLM's ``stream_options.continuous_usage_stats`` (guidellm sends it): with
    include_usage, each chunk carries the usage so far; the last one the whole."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    for stream in (
        client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                  stream=True, stream_options=options,
                                  extra_body={"ignore_eos": True}),
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0,
                                       stream=True, stream_options=options,
                                       extra_body={"ignore_eos": True})):
        chunks = list(stream)
        counts = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage is not None for c in chunks)
        assert counts == sorted(counts) and counts[-1] == 6
        assert len({c.usage.prompt_tokens for c in chunks}) == 1


def test_async_client_streams_concurrently(server, eng):
    from openai import AsyncOpenAI

    async def one(c, prompt):
        stream = await c.completions.create(model="tiny", prompt=prompt, max_tokens=10,
                                            temperature=0, stream=True)
        return "".join([ch.choices[0].text async for ch in stream])

    async def main():
        c = AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(c, p) for p in PROMPTS))
    texts = asyncio.run(main())
    for prompt, text in zip(PROMPTS, texts):
        assert text == eng.generate(prompt, {"max_new_tokens": 10, "temperature": 0})["text"]


def test_n_logprobs_and_seed(client):
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0,
                                       n=2, logprobs=True, top_logprobs=3)
    assert len(r.choices) == 2 and r.choices[0].message.content == r.choices[1].message.content
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens // 2
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    a = client.completions.create(model="tiny", prompt="the", max_tokens=8, temperature=1.0, seed=7)
    b = client.completions.create(model="tiny", prompt="the", max_tokens=8, temperature=1.0, seed=7)
    assert a.choices[0].text == b.choices[0].text


def test_native_generate_matches_engine(server, eng):
    want = eng.generate("the quick brown fox", {"max_new_tokens": 10, "temperature": 0})
    r = httpx.post(f"{server}/generate", json={"text": "the quick brown fox", "return_logprob": True,
                                               "sampling_params": {"max_new_tokens": 10,
                                                                   "temperature": 0}}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output_ids"] == want["output_ids"] and body["text"] == want["text"]
    meta = body["meta_info"]
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                "queue_time", "first_token_latency", "e2e_latency", "num_retractions",
                "weight_version"):
        assert key in meta, key
    assert [t for _, t, _ in meta["output_token_logprobs"]] == want["output_ids"]
    events = []
    with httpx.stream("POST", f"{server}/generate", json={
            "input_ids": want["output_ids"][:3] + [5, 6], "stream": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                "ignore_eos": True}}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert events[-1]["meta_info"]["completion_tokens"] == 5 == len(events[-1]["output_ids"])


def test_repeated_prompt_reports_cached_tokens(server, client):
    prompt = "the cat sat on the mat and the dog sat on the log " * 3
    for _ in range(2):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1
    for _ in range(2):
        body = httpx.post(f"{server}/generate", json={
            "text": prompt + "again", "sampling_params": {"max_new_tokens": 2}}).json()
    assert body["meta_info"]["cached_tokens"] > 0


def test_metrics_move_by_the_request(server):
    ids = [(7 * i + 3) % 300 + 1 for i in range(40)]  # 40 tokens nobody sent before
    def scrape():
        return httpx.get(f"{server}/metrics", timeout=60).text
    before = scrape()
    for _ in range(2):
        r = httpx.post(f"{server}/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": 7, "ignore_eos": True, "temperature": 0}})
        assert r.status_code == 200
    after = scrape()

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)
    assert delta("radixray:prompt_tokens_total") == 80
    assert delta("radixray:generation_tokens_total") == 14
    # first pass computes all 40; the second reuses 39 (the last prompt token always runs)
    assert delta("radixray:prefill_effective_tokens_total", mode="input") == 41
    assert delta("radixray:prefill_effective_tokens_total", mode="device_hit") == 39
    assert delta("radixray:requests_total", finish_reason="length") == 2
    assert delta("radixray:time_to_first_token_seconds_count") == 2
    assert delta("radixray:inter_token_latency_seconds_count") == 12
    assert 'worker="worker-0"' in after
    for gauge in ("num_running_reqs", "num_queue_reqs", "token_usage", "gen_throughput",
                  "num_used_tokens", "max_total_num_tokens", "cache_hit_rate",
                  "startup_seconds", "weight_load_seconds", "kv_slot_leak"):
        assert f"radixray:{gauge}{{" in after
    assert metric(after, "radixray:max_total_num_tokens") == 4096  # the tiny config's pool
    assert metric(after, "radixray:num_used_tokens") == 0  # idle: cached prefixes are evictable
    assert metric(after, "radixray:cache_hit_rate") > 0  # the second request hit
    assert metric(after, "radixray:startup_seconds") >= metric(
        after, "radixray:weight_load_seconds") > 0
    assert delta("radixray:time_per_output_token_seconds_count") == 2
    assert delta("radixray:goodput_requests_total") == 2
    assert metric(after, "radixray:kv_slot_leak") == 0  # the production audit found no leak
    assert metric(after, "radixray:slo_target_seconds", slo="ttft") == 3600.0
    # the ingress' own series: the two requests by route template and status
    assert delta("radixray:http_request_duration_seconds_count", route="/generate",
                 method="POST", status="200") == 2


LONG = "the cat sat on the mat " * 300  # over the tiny model's 1024-token context

BAD_CHAT = [
    ("{not json", "Malformed JSON", None),
    ({"model": "tiny"}, "messages: Field required", "messages"),
    ({"messages": []}, "at least 1 item", "messages"),
    ({"messages": "hello"}, "messages", "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "messages.0.role"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "greater than or equal to 1", "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, "max_tokens", "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature",
     "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}, "does not exist", "model"),
    ({"messages": [{"role": "user", "content": LONG}]}, "maximum context length is 1024", "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, "Lower max_tokens",
     "max_tokens"),
    # Fields this server does not implement are refused by name, never dropped silently.
    ({"messages": [{"role": "user", "content": "hi"}], "functions": []}, "does not implement",
     "functions"),
    # The tiny model's chat template takes no tools.
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function":
     {"name": "f"}}]}, "--generic-tool-prompt", "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 10}},
     "does not implement", "logit_bias"),
    ({"messages": [{"role": "assistant", "content": None, "function_call": {}}]},
     "does not implement", "messages.0.function_call"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"x": 1}},
     "does not implement", "stream_options.x"),
]


@pytest.mark.parametrize("body,needle,param", BAD_CHAT)
def test_bad_chat_input_is_a_clear_400(server, client, body, needle, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server}/v1/chat/completions", content=content,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == param
    ok = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_openai_fields_that_cannot_change_output_are_accepted(client):
    """user, metadata, store and service_tier label a request; they are taken and ignored."""
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, user="u-1",
                                       metadata={"run": "a"}, store=False,
                                       service_tier="auto")
    assert r.choices[0].finish_reason in ("stop", "length")
    c = client.completions.create(model="tiny", prompt="hi", max_tokens=2, user="u-1")
    assert c.choices[0].finish_reason in ("stop", "length")


def test_json_body_without_json_content_type(server):
    """`curl -d` sends application/x-www-form-urlencoded; the body is still read as JSON."""
    r = httpx.post(f"{server}/generate", content=json.dumps({"text": "hi", "sampling_params": {
        "max_new_tokens": 2}}), headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] <= 2


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/completions", {"prompt": ""}, "empty"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, "outside the vocabulary"),
    ("/v1/completions", {"prompt": LONG}, "maximum context length"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of: this server does not implement"),
    ("/generate", {"text": "hi", "sampling_params": {"bogus": 1}}, "bogus"),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
    ("/generate", {"sampling_params": {}}, "exactly one of text or input_ids"),
    ("/generate", {"input_ids": [1, "x"]}, "input_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"return_routed_experts": True}},
     "needs a mixture-of-experts model"),  # a dense model has no routes to return
    ("/generate", {"text": "hi", "return_routed_experts": True}, "needs a mixture-of-experts"),
])
def test_bad_completion_and_generate_input(server, path, body, needle):
    r = httpx.post(server + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert httpx.post(f"{server}/generate", json={"text": "hi"}, timeout=60).status_code == 200


def test_client_disconnect_aborts_and_returns_kv(server):
    assert_disconnect_returns_kv(server)


def test_pause_and_continue_generation_on_the_whole_fleet(server):
    """POST /pause_generation (abort) ends the running request; a request sent while paused
    waits in the queue until POST /continue_generation; a bad mode is a 400. A long request
    that finished before the pause reached it is sent again (up to PAUSE_ATTEMPTS), and the
    fleet is resumed whatever happens."""
    import threading
    import time
    box = {}

    def post(key, max_new_tokens):
        box[key] = httpx.post(f"{server}/generate", timeout=120, json={
            "text": "the cat", "sampling_params": {"max_new_tokens": max_new_tokens,
                                                   "ignore_eos": True}})

    def worker0():
        return httpx.get(f"{server}/debug/kv_conservation", timeout=60).json()["worker-0"]

    def wait_for(what: str, key: str, thread) -> None:
        """Poll worker 0 until it has a request ``what`` (running or waiting), failing with
        what it saw if the request ``key`` ended first or 90 s pass."""
        deadline = time.monotonic() + 90
        while (seen := worker0())[what] < 1:
            assert thread.is_alive(), (f"{key} ended before it was {what}: "
                                       f"{getattr(box.get(key), 'text', 'no answer')[:300]}")
            assert time.monotonic() < deadline, f"no request {what} after 90 s: {seen}"
            time.sleep(0.05)
    try:
        for _ in range(PAUSE_ATTEMPTS):
            long = threading.Thread(target=post, args=("long", 1000))
            long.start()
            wait_for("running", "long", long)
            r = httpx.post(f"{server}/pause_generation", json={"mode": "abort"}, timeout=60)
            assert r.status_code == 200, r.text
            long.join(60)
            if r.json()["requests"] != {"worker-0": 0}:
                break
            # the request finished between the poll and the pause (a fast host): again
            assert box["long"].json()["meta_info"]["finish_reason"]["type"] == "length"
            httpx.post(f"{server}/continue_generation", timeout=60)
        assert r.json() == {"mode": "abort", "requests": {"worker-0": 1}}
        assert box["long"].json()["meta_info"]["finish_reason"]["type"] == "abort"
        held = threading.Thread(target=post, args=("held", 3))
        held.start()
        wait_for("waiting", "held", held)
        assert "held" not in box
        r = httpx.post(f"{server}/continue_generation", timeout=60)
        assert r.status_code == 200 and r.json() == {"was_paused": {"worker-0": True}}
        held.join(60)
        assert box["held"].json()["meta_info"]["completion_tokens"] == 3
        bad = httpx.post(f"{server}/pause_generation", json={"mode": "sideways"}, timeout=60)
        assert bad.status_code == 400 and "mode" in bad.json()["error"]["message"]
    finally:  # a failure above must not leave the fleet paused for the next test
        httpx.post(f"{server}/continue_generation", timeout=60)


def test_a_full_queue_is_refused_at_once_with_retry_after(server):
    """With generation paused nothing is admitted: QUEUE_BOUND requests wait, the next one
    is a 503 with Retry-After (not a wait), and the waiting ones all finish afterwards."""
    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            r = await c.post(f"{server}/pause_generation", json={"mode": "in_place"})
            assert r.status_code == 200, r.text
            try:
                waiting = [asyncio.ensure_future(c.post(f"{server}/generate", json={
                    "text": f"queued {i}", "sampling_params": {"max_new_tokens": 1}}))
                    for i in range(QUEUE_BOUND)]
                deadline, queued = time.monotonic() + 90, None
                while queued != QUEUE_BOUND:  # until the worker holds all of them
                    assert time.monotonic() < deadline, (
                        f"the worker's queue reached {queued} of {QUEUE_BOUND} in 90 s; "
                        f"requests done: {sum(w.done() for w in waiting)}")
                    await asyncio.sleep(0.05)
                    text = (await c.get(f"{server}/metrics")).text
                    queued = metric(text, "radixray:num_queue_reqs")
                # a full queue answers at once: a wait here would be admission into the pause
                refused = await c.post(f"{server}/generate", json={"text": "one too many"},
                                       timeout=30)
            finally:
                await c.post(f"{server}/continue_generation")
            return refused, await asyncio.gather(*waiting)
    refused, done = asyncio.run(main())
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["code"] == "queue_full" and "server.max_queued_requests=24" in error["message"]
    assert [r.status_code for r in done] == [200] * QUEUE_BOUND


@pytest.mark.parametrize("body, status, needle", [
    ({"prompt": "hi", "n": 65}, 400, "server.max_n"),
    ({"prompt": "hi", "stop": [str(i) for i in range(17)]}, 400, "server.max_stop_sequences"),
    ({"prompt": "hi", "logprobs": 21}, 400, "server.max_top_logprobs"),
    ({"prompt": "x" * (33 * 2**20)}, 413, "server.max_request_body_bytes"),
])
def test_request_limits_through_the_app(server, body, status, needle):
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text
