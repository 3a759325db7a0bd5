"""``radixray bench serve`` and ``bench cache-experiment``: metric maths, datasets, and runs against a fake server."""

import argparse
import asyncio
import json
import os
import random
import socket
import threading
import time

import numpy as np
import pytest
from model_fixtures import byte_bpe_tokenizer

from radixray.bench import cache_experiment, datasets, serve_client, stream_client
from radixray.bench.serve_metrics import (
    RequestRecord,
    format_summary,
    format_sweep_table,
    percentile,
    summarize,
)
from radixray.bench.sweep_plot import find_knee

FAIL_MARKER = "FAIL-WITH-500"
STREAM_ERROR_MARKER = "FAIL-MID-STREAM"
NO_USAGE_MARKER = "NO-USAGE-CHUNK"
CHUNK_DELAY = 0.004


# --------------------------------------------------------------------------- metrics

def rec(i, *, ok=True, prompt=10, out=5, cached=None, ttft=0.1, itl=(), latency=0.5):
    return RequestRecord(index=i, prompt_tokens=prompt, output_tokens=out, cached_tokens=cached,
                         ttft=ttft, itl=list(itl), latency=latency, success=ok,
                         error=None if ok else "boom")


def test_percentile_matches_numpy():
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        xs = [rng.random() for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert percentile([], 50) is None


def test_tpot_rule():
    assert rec(0, out=5, ttft=0.2, latency=1.0).tpot == pytest.approx(0.2)
    assert rec(0, out=1).tpot is None        # no decode step
    assert rec(0, ok=False).tpot is None     # failed requests have no TPOT


def test_summarize_hand_records():
    records = [
        rec(0, prompt=100, out=3, cached=40, ttft=0.1, itl=[0.2, 0.2], latency=0.5),
        rec(1, prompt=50, out=11, cached=None, ttft=0.3, itl=[0.01] * 10, latency=0.4),
        rec(2, ok=False, prompt=999, out=999, ttft=None, latency=0.05),
    ]
    s = summarize(records, duration=2.0, label="x", max_concurrency=4)
    assert (s["completed"], s["failed"], s["num_requests"]) == (2, 1, 3)
    assert s["total_input_tokens"] == 150 and s["total_output_tokens"] == 14
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(7.0)
    assert s["total_throughput"] == pytest.approx(82.0)
    assert s["concurrency"] == pytest.approx((0.5 + 0.4) / 2.0)
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["mean_e2e_latency_ms"] == pytest.approx(450.0)
    # TPOT per request: (0.5-0.1)/2 = 0.2 and (0.4-0.3)/10 = 0.01.
    assert s["mean_tpot_ms"] == pytest.approx(105.0)
    # ITL values are pooled: 12 gaps, not the mean of two per-request means.
    assert s["mean_itl_ms"] == pytest.approx((0.4 + 0.1) / 12 * 1000)
    assert s["median_itl_ms"] == pytest.approx(10.0)
    assert s["max_itl_ms"] == pytest.approx(200.0)
    assert s["p99_ttft_ms"] == pytest.approx(np.percentile([100, 300], 99))
    # Only the request that reported cached tokens enters the hit rate.
    assert s["total_cached_tokens"] == 40 and s["cache_hit_rate"] == pytest.approx(0.4)
    assert s["goodput"] is None


def test_no_cache_report_and_no_success():
    s = summarize([rec(0, ok=False)], duration=1.0)
    assert s["completed"] == 0 and s["mean_ttft_ms"] is None and s["total_cached_tokens"] is None
    assert "n/a" in format_summary(s)


def test_goodput_slos():
    records = [rec(0, ttft=0.1, out=11, latency=0.1 + 10 * 0.02),   # TPOT 20 ms
               rec(1, ttft=0.5, out=11, latency=0.5 + 10 * 0.05),   # TTFT 500 ms, TPOT 50 ms
               rec(2, ttft=0.05, out=1, latency=0.05),              # no TPOT: meets any TPOT SLO
               rec(3, ok=False)]
    def goodput(**slo):
        return summarize(records, 2.0, **slo)["goodput"]
    assert goodput(slo_ttft_ms=200) == pytest.approx(2 / 2.0)
    assert goodput(slo_tpot_ms=30) == pytest.approx(2 / 2.0)
    assert goodput(slo_tpot_ms=60) == pytest.approx(3 / 2.0)
    assert goodput(slo_ttft_ms=200, slo_tpot_ms=10) == pytest.approx(1 / 2.0)
    assert goodput(slo_ttft_ms=1000, slo_tpot_ms=100) == pytest.approx(3 / 2.0)
    text = format_summary(summarize(records, 2.0, slo_ttft_ms=200))
    assert "Goodput" in text and "ttft <= 200 ms" in text
    assert "Goodput" not in format_summary(summarize(records, 2.0))


def test_format_summary_and_table():
    s = summarize([rec(0, cached=5)], 1.0, label="radixray", max_concurrency=8)
    text = format_summary(s)
    assert "Serving Benchmark Result" in text and "radixray" in text
    assert "Cache hit rate" in text and "P99 TTFT (ms):" in text and "Max ITL (ms):" in text
    table = format_sweep_table([s, summarize([rec(0)], 1.0, label="naive")])
    assert len(table.splitlines()) == 3 and "p99 TTFT ms" in table


def test_knee_rule():
    assert find_knee([100, 180, 250, 260, 300]) == 4   # 260 -> 300 is +15%
    assert find_knee([100, 180, 250, 260, 270]) == 2
    assert find_knee([100, 105]) == 0
    assert find_knee([]) == -1


def test_poisson_arrivals_seeded():
    assert stream_client.arrival_offsets(3, float("inf"), 1) == [0.0, 0.0, 0.0]
    a = stream_client.arrival_offsets(2000, 10.0, 7)
    assert a == stream_client.arrival_offsets(2000, 10.0, 7) and a[0] == 0.0
    assert np.mean(np.diff(a)) == pytest.approx(0.1, rel=0.1)


def test_request_body_and_flags():
    args = bench_args("serve", "--no-ignore-eos", "--api", "chat", "--sweep", "1,4")
    assert args.ignore_eos is False and args.sweep == [1, 4] and args.request_rate == float("inf")
    body = stream_client.request_body("chat", "m", [{"role": "user", "content": "hi"}], 7,
                                     ignore_eos=args.ignore_eos)
    assert "ignore_eos" not in body and body["stream_options"] == {"include_usage": True}
    assert stream_client.request_body("completions", "m", "hi", 7)["ignore_eos"] is True
    with pytest.raises(SystemExit):
        bench_args("serve", "--target", "no-url-here")


# --------------------------------------------------------------------------- datasets

@pytest.fixture(scope="module")
def tok():
    return byte_bpe_tokenizer()


def test_random_prompts_exact_and_seeded(tok):
    items = datasets.build_random(tok, 20, input_len=64, output_len=8, range_ratio=0.5, seed=3)
    for it in items:
        assert datasets.count_tokens(tok, it.turns[0]) == it.prompt_len
        assert 32 <= it.prompt_len <= 64 and 4 <= it.output_len <= 8
    again = datasets.build_random(tok, 20, 64, 8, 0.5, seed=3)
    assert [i.turns for i in again] == [i.turns for i in items]
    assert datasets.build_random(tok, 20, 64, 8, 0.5, seed=4)[0].turns != items[0].turns
    fixed = datasets.build_random(tok, 5, 100, 8, range_ratio=1.0, seed=1)
    assert {i.prompt_len for i in fixed} == {100} and {i.output_len for i in fixed} == {8}


def test_range_ratio_bounds():
    rng = random.Random(0)
    lens = datasets.sample_lengths(rng, 5000, 20, 0.25)
    assert min(lens) == 5 and max(lens) == 20   # [max(int(20*0.25), 1), 20], both ends inclusive
    assert set(datasets.sample_lengths(rng, 2000, 3, 0.0)) == {1, 2, 3}


def test_shared_prefix_groups(tok):
    items = datasets.build_shared_prefix(tok, 3, 4, system_len=40, question_len=8,
                                         output_len=6, seed=2)
    assert len(items) == 12 and [i.index for i in items] == list(range(12))
    assert [i.group for i in items] != sorted(i.group for i in items)  # shuffled
    systems = {g: {i.system for i in items if i.group == g} for g in range(3)}
    assert all(len(s) == 1 for s in systems.values())
    assert len({next(iter(s)) for s in systems.values()}) == 3
    assert len({i.turns[0] for i in items}) == 12
    assert all(datasets.count_tokens(tok, i.system) == 40 for i in items)
    item = items[0]
    assert stream_client.build_prompt("completions", item, 0, []) == item.system + item.turns[0]
    msgs = stream_client.build_prompt("chat", item, 0, [])
    assert [m["role"] for m in msgs] == ["system", "user"] and msgs[0]["content"] == item.system
    ordered = datasets.build_shared_prefix(tok, 3, 4, 40, 8, 6, seed=2, shuffle=False)
    assert [i.group for i in ordered] == sorted(i.group for i in ordered)


def test_multi_turn_history_grows(tok):
    (conv,) = datasets.build_multi_turn(tok, users=1, turns=3, turn_len=10, output_len=4, seed=1)
    assert conv.session_id == "user-0" and conv.turn_lens == [10, 10, 10]
    replies = ["reply one", "reply two"]
    texts = [stream_client.build_prompt("completions", conv, k, replies[:k]) for k in range(3)]
    for k in range(1, 3):
        assert texts[k].startswith(texts[k - 1] + replies[k - 1]) and texts[k].endswith(conv.turns[k])
    msgs = stream_client.build_prompt("chat", conv, 2, replies)
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in msgs[1::2]] == replies


# --------------------------------------------------------------------------- fake server

class FakeServer:
    """Streams ``max_tokens`` one-word chunks; reports cached tokens as the longest
    character prefix shared with any earlier prompt (a character-level prefix cache)."""

    def __init__(self):
        self.log: list[dict] = []
        self.seen: list[str] = []
        self.url = ""

    def reset(self):
        self.log.clear()
        self.seen.clear()

    def app(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, StreamingResponse

        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        async def complete(request: Request, chat: bool):
            body = await request.json()
            text = ("".join(m["content"] for m in body["messages"]) if chat else body["prompt"])
            self.log.append({"body": body, "session": request.headers.get("x-session-id"),
                             "text": text})
            if FAIL_MARKER in text:
                return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
            cached = max((len(os.path.commonprefix([text, s])) for s in self.seen), default=0)
            self.seen.append(text)
            usage = {"prompt_tokens": len(text), "completion_tokens": body["max_tokens"],
                     "total_tokens": len(text) + body["max_tokens"],
                     "prompt_tokens_details": {"cached_tokens": cached}}
            return StreamingResponse(self._stream(body, text, chat, usage),
                                     media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await complete(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await complete(request, chat=True)

        return app

    async def _stream(self, body, text, chat, usage):
        def event(obj):
            return f"data: {json.dumps(obj)}\n\n"
        if chat:  # the role-only first chunk carries no text and must not end TTFT
            yield event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i in range(body["max_tokens"]):
            await asyncio.sleep(CHUNK_DELAY)
            if STREAM_ERROR_MARKER in text and i == 1:
                yield event({"error": {"message": "injected stream error"}})
                return
            piece = f"w{i} "
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            yield event({"choices": [choice]})
        if NO_USAGE_MARKER not in text and body.get("stream_options", {}).get("include_usage"):
            yield event({"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"


@pytest.fixture(scope="module")
def fake():
    import uvicorn
    server = FakeServer()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    uv = uvicorn.Server(uvicorn.Config(server.app(), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not uv.started:
        assert time.time() < deadline and thread.is_alive(), "fake server did not start"
        time.sleep(0.02)
    yield server
    uv.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture
def tok_dir(tmp_path, tok):
    tok.save_pretrained(str(tmp_path / "tok"))
    return str(tmp_path / "tok")


def bench_args(*argv):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="bench_command", required=True)
    serve_client.add_parser(sub)
    cache_experiment.add_parser(sub)
    return parser.parse_args(list(argv))


def test_runner_counts_failures_and_times(fake, tok):
    fake.reset()
    items = datasets.build_random(tok, 6, input_len=16, output_len=5, range_ratio=1.0, seed=1)
    for marker in (FAIL_MARKER, STREAM_ERROR_MARKER, NO_USAGE_MARKER):
        items.append(datasets.Conversation(index=len(items), turns=[marker + " please"],
                                           output_len=5, prompt_len=3))
    cfg = stream_client.RunConfig(base_url=fake.url, model="fake-model", label="fake",
                                 max_concurrency=3, warmup=1, progress=False)
    count = lambda text: datasets.count_tokens(tok, text)  # noqa: E731
    records, duration = asyncio.run(stream_client.run_benchmark(cfg, items, count))

    assert len(fake.log) == 1 + len(items)   # one warm-up request, then every item once
    assert all(e["body"]["ignore_eos"] is True and e["body"]["stream"] for e in fake.log)
    by_index = {r.index: r for r in records}
    assert "HTTP 500" in by_index[6].error and "error event" in by_index[7].error
    assert not by_index[6].success and not by_index[7].success
    no_usage = by_index[8]
    assert no_usage.success and no_usage.cached_tokens is None and no_usage.prompt_tokens == 3
    assert no_usage.output_tokens == count("w0 w1 w2 w3 w4 ")
    for r in records[:6]:
        assert r.success and r.output_tokens == 5 and r.prompt_tokens == len(items[r.index].turns[0])
        assert CHUNK_DELAY * 0.8 <= r.ttft < 2.0 and len(r.itl) == 4
        # Gaps can shrink when the client reads late, but not all of them at once.
        assert sum(r.itl) >= 4 * CHUNK_DELAY * 0.5 and r.latency >= r.ttft + sum(r.itl) - 1e-9

    s = summarize(records, duration, label="fake")
    assert (s["completed"], s["failed"]) == (7, 2)
    assert s["total_output_tokens"] == 6 * 5 + no_usage.output_tokens
    assert s["total_input_tokens"] == sum(len(i.turns[0]) for i in items[:6]) + 3
    assert s["median_itl_ms"] >= CHUNK_DELAY * 1000 * 0.7
    assert s["total_cached_tokens"] is not None and 0 <= s["cache_hit_rate"] <= 1


def test_multi_turn_chat_carries_history_and_session(fake, tok):
    fake.reset()
    convs = datasets.build_multi_turn(tok, users=3, turns=3, turn_len=8, output_len=4, seed=1)
    cfg = stream_client.RunConfig(base_url=fake.url, model="fake-model", api="chat",
                                 max_concurrency=2, warmup=0, progress=False)
    records, _ = asyncio.run(stream_client.run_benchmark(cfg, convs, lambda t: len(t)))
    assert len(records) == 9 and all(r.success for r in records)
    assert [(r.session_id, r.turn) for r in records] == [(f"user-{u}", k) for u in range(3) for k in range(3)]
    for u, conv in enumerate(convs):
        mine = [e for e in fake.log if e["session"] == f"user-{u}"]
        assert [len(e["body"]["messages"]) for e in mine] == [1, 3, 5]
        last = mine[-1]["body"]["messages"]
        assert [m["content"] for m in last[::2]] == conv.turns
        assert [m["content"] for m in last[1::2]] == ["w0 w1 w2 w3 "] * 2
    # Later turns re-send the whole history, so the fake's prefix cache reports hits.
    assert all(r.cached_tokens > 0 for r in records if r.turn > 0)


def test_cli_sweep_writes_table_jsonl_json_and_png(fake, tok_dir, tmp_path, capsys):
    fake.reset()
    png, jsonl, js = (str(tmp_path / n) for n in ("sweep.png", "req.jsonl", "sum.json"))
    args = bench_args("serve", "--target", f"fake={fake.url}", "--tokenizer", tok_dir,
                      "--num-prompts", "4", "--random-input-len", "12", "--random-output-len", "3",
                      "--random-range-ratio", "1",
                      "--sweep", "1,2", "--plot", png, "--output-jsonl", jsonl, "--output-json", js,
                      "--slo-ttft-ms", "5000", "--disable-tqdm")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.count("Serving Benchmark Result") == 2 and "p50 TTFT ms" in out and "Goodput" in out
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    lines = [json.loads(line) for line in open(jsonl)]
    assert len(lines) == 8 and {ln["concurrency"] for ln in lines} == {1, 2}
    assert all(ln["success"] and ln["label"] == "fake" and ln["output_tokens"] == 3 for ln in lines)
    assert {"ttft", "itl", "latency", "tpot", "cached_tokens", "prompt_tokens", "turn"} <= set(lines[0])
    summaries = json.load(open(js))
    assert [s["max_concurrency"] for s in summaries] == [1, 2] and summaries[0]["request_rate"] == "inf"
    # Each sweep point draws its own prompts (so a prefix cache cannot carry one point into
    # the next), and the warm-up prompt is never measured.
    sent = [e["body"]["prompt"] for e in fake.log]
    assert len(sent) == 10 and not set(sent[:5]) & set(sent[5:])
    assert sent[0] not in sent[1:5] and sent[5] not in sent[6:]


def test_cli_unreachable_server_fails_cleanly(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = bench_args("serve", "--base-url", f"http://127.0.0.1:{port}", "--disable-tqdm")
    assert args.func(args) != 0
    assert f"127.0.0.1:{port}" in capsys.readouterr().err


def test_cache_experiment_three_forms(fake, tok_dir, tmp_path, capsys):
    fake.reset()
    out_json = str(tmp_path / "cache.json")
    args = bench_args("cache-experiment", "--base-url", fake.url, "--tokenizer", tok_dir,
                      "--system-prompt-len", "200", "--repeats", "3", "--max-tokens", "2",
                      "--output-json", out_json)
    assert args.func(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["summary"] for r in lines] == list(cache_experiment.FORMS) == \
        [r["summary"] for r in json.load(open(out_json))]
    assert len(fake.log) == 2 + 3 * 3
    system = fake.log[2]["body"]["messages"][0]["content"]
    stable, at_start, at_end = lines
    assert all(r["failed"] == 0 and r["min_ttft_ms"] <= r["median_ttft_ms"] <= r["max_ttft_ms"]
               for r in lines)
    # The fake caches by character prefix: only the id at the start defeats it.
    assert stable["median_cached_tokens"] >= len(system)
    assert at_end["median_cached_tokens"] >= len(system)
    assert at_start["median_cached_tokens"] < 40
    ids = [e["body"]["messages"][0]["content"][11:27] for e in fake.log[5:8]]
    assert len(set(ids)) == 3 and all(len(i) == 16 for i in ids)


def test_multi_turn_think_time_is_seeded_and_waited(fake, tok):
    fake.reset()
    convs = datasets.build_multi_turn(tok, users=2, turns=3, turn_len=4, output_len=2, seed=5,
                                      think_time=0.2)
    again = datasets.build_multi_turn(tok, users=2, turns=3, turn_len=4, output_len=2, seed=5,
                                      think_time=0.2)
    assert [c.think_times for c in convs] == [c.think_times for c in again]
    assert all(len(c.think_times) == 2 and all(t > 0 for t in c.think_times) for c in convs)
    cfg = stream_client.RunConfig(base_url=fake.url, model="fake-model", api="chat", warmup=0,
                                 progress=False)
    records, duration = asyncio.run(stream_client.run_benchmark(cfg, convs, lambda t: len(t)))
    assert all(r.success for r in records)
    assert duration >= max(sum(c.think_times) for c in convs)
    assert datasets.build_multi_turn(tok, users=1, turns=2, turn_len=4,
                                     output_len=2)[0].think_times == [0.0]
