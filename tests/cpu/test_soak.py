"""Soak (slow: `make test-slow`): 10,000 requests of mixed shapes against `radixray serve`
(the CLI, one tiny-Llama worker): streams the client drops midway, `n` > 1, stop strings,
requests refused for a bad field. Every request ends (finished, refused with a 4xx, or
dropped by its client), none hangs, every KV slot is free or cached at the end, and the
worker's resident memory is flat: less than 5% growth between the end of the second
thousand and the end of the run. The figures go to docs/reliability.md."""

import asyncio
import json
import random
import subprocess
import time

import httpx
import pytest
from serving_helpers import free_port, start_radixray_serve, wait_ready

TOTAL, CONCURRENCY, SAMPLE_AT = 10_000, 32, 2_000
WORDS = "the cat sat on a mat while dogs ran past quick brown foxes and one red bird".split()


def _body(rng: random.Random) -> tuple[dict, str]:
    """A request body and what it should do: ok, drop (client leaves mid-stream), bad."""
    kind = rng.choices(["ok", "n", "stop", "drop", "bad"], [50, 15, 15, 15, 5])[0]
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120)))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": rng.randint(1, 24),
            "temperature": rng.choice([0.0, 0.7, 1.0]), "ignore_eos": rng.random() < 0.5}
    if kind == "n":
        body["n"] = rng.randint(2, 4)
    elif kind == "stop":
        body["stop"] = rng.sample(WORDS, rng.randint(1, 4))
    elif kind == "drop":
        body.update(stream=True, max_tokens=64, ignore_eos=True)
    elif kind == "bad":
        body["max_tokens"] = 5000  # past the tiny model's 1024-token context: a 400
    return body, kind


async def _one(client, base, body, kind, rng) -> str:
    if kind == "drop":
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            for _ in range(rng.randint(1, 6)):
                await anext(lines)
        return "dropped"
    r = await client.post(f"{base}/v1/completions", json=body)
    if kind == "bad":
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        return "refused"
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["choices"]) == body.get("n", 1)
    assert all(c["finish_reason"] in ("stop", "length") for c in out["choices"])
    return "finished"


def _worker_rss(cli: int) -> int:
    import psutil
    workers = [p for p in psutil.Process(cli).children(recursive=True)
               if "EngineWorker" in " ".join(p.cmdline())]
    assert len(workers) == 1, workers
    return workers[0].memory_info().rss


@pytest.mark.slow
def test_ten_thousand_mixed_requests_all_end_and_leak_nothing(tiny_llama_dir, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w")
    proc = start_radixray_serve(tiny_llama_dir, port, log, max_total_tokens=8192)
    try:
        wait_ready(base)
        outcomes: dict[str, int] = {}
        rss: dict[int, int] = {}
        rng = random.Random(0)
        bodies = [_body(rng) for _ in range(TOTAL)]
        t0 = time.perf_counter()

        async def main():
            queue = iter(enumerate(bodies))
            async with httpx.AsyncClient(timeout=120,
                                         limits=httpx.Limits(max_connections=64)) as client:
                async def user(seed: int):
                    local = random.Random(seed)
                    for i, (body, kind) in queue:
                        outcome = await _one(client, base, body, kind, local)
                        outcomes[outcome] = outcomes.get(outcome, 0) + 1
                        if i + 1 in (SAMPLE_AT, TOTAL):
                            rss[i + 1] = _worker_rss(proc.pid)
                await asyncio.gather(*(user(s) for s in range(CONCURRENCY)))
        asyncio.run(main())
        elapsed = time.perf_counter() - t0
        kv = None
        for _ in range(300):  # dropped streams are aborted asynchronously
            kv = httpx.get(f"{base}/debug/kv_conservation", timeout=60).json()["worker-0"]
            if kv["running"] == 0 and kv["waiting"] == 0:
                break
            time.sleep(0.1)
        rss[TOTAL] = _worker_rss(proc.pid)
        figures = {"requests": TOTAL, "concurrency": CONCURRENCY, "seconds": round(elapsed, 1),
                   "outcomes": outcomes, "kv": kv,
                   "worker_rss_mib": {k: round(v / 2**20, 1) for k, v in sorted(rss.items())}}
        print("SOAK", json.dumps(figures))
        (tmp_path / "soak.json").write_text(json.dumps(figures))
        assert sum(outcomes.values()) == TOTAL
        assert kv["running"] == 0 and kv["waiting"] == 0
        assert kv["free"] + kv["cached"] == kv["pool"]
        assert rss[TOTAL] < 1.05 * rss[SAMPLE_AT], figures["worker_rss_mib"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
