"""What a benchmark run reads from, and sets on, a radixray server besides its API.

- Server-side prefix-cache hit rate of a run: the change of the
  ``radixray:prefill_effective_tokens_total{mode=input|device_hit}`` counters
  across the run (all workers summed), and how the router spread the run's
  requests (``radixray:router_requests_total`` by worker).
- Fleet knobs for side-by-side runs: the routing policy (``POST /fleet/router``)
  and a cold start (``POST /flush_cache``).

Servers without these endpoints (any other OpenAI-compatible server) give None.
"""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([^{ ]+)(?:\{(.*)\})? (\S+)$")


def scrape(base_url: str) -> dict | None:
    """The counters a run's summary needs, or None when /metrics has no radixray series."""
    import httpx
    try:
        r = httpx.get(base_url.rstrip("/") + "/metrics", timeout=60)
    except httpx.HTTPError:
        return None
    if r.status_code != 200 or "radixray:prefill_effective_tokens_total" not in r.text:
        return None
    out = {"input": 0.0, "device_hit": 0.0, "requests_by_worker": {}, "kv_bytes": 0.0,
           "kv_seconds": 0.0, "kv_transfers": 0.0}
    kv = {"radixray:kv_transfer_bytes_total": "kv_bytes",
          "radixray:kv_transfer_latency_seconds_sum": "kv_seconds",
          "radixray:kv_transfer_latency_seconds_count": "kv_transfers"}
    for line in r.text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or line.startswith("#"):
            continue
        name, labels, value = m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")), float(m.group(3))
        if name == "radixray:prefill_effective_tokens_total" and labels.get("mode") in out:
            out[labels["mode"]] += value
        elif name in kv:
            out[kv[name]] += value
        elif name == "radixray:router_requests_total":
            w = labels.get("worker", "?")
            out["requests_by_worker"][w] = out["requests_by_worker"].get(w, 0.0) + value
    return out


def run_delta(before: dict | None, after: dict | None) -> dict:
    """Summary fields for one run: server_hit_rate, server_input/cached tokens, per-worker
    request counts, and on a disaggregated fleet the KV transfers (count, bytes, and the
    rate while writing: bytes over the senders' write time); None/empty without radixray
    metrics."""
    if before is None or after is None:
        return {"server_hit_rate": None, "server_computed_tokens": None,
                "server_cached_tokens": None, "requests_by_worker": {}, "kv_transfers": 0,
                "kv_transfer_bytes": 0, "kv_transfer_rate": None}
    computed = after["input"] - before["input"]
    cached = after["device_hit"] - before["device_hit"]
    total = computed + cached
    workers = {w: int(n - before["requests_by_worker"].get(w, 0.0))
               for w, n in sorted(after["requests_by_worker"].items())}
    kv_bytes = after["kv_bytes"] - before["kv_bytes"]
    kv_seconds = after["kv_seconds"] - before["kv_seconds"]
    return {"server_hit_rate": cached / total if total else None,
            "server_computed_tokens": int(computed), "server_cached_tokens": int(cached),
            "requests_by_worker": {w: n for w, n in workers.items() if n},
            "kv_transfers": int(after["kv_transfers"] - before["kv_transfers"]),
            "kv_transfer_bytes": int(kv_bytes),
            "kv_transfer_rate": kv_bytes / kv_seconds if kv_seconds > 0 else None}


def prepare_policy_run(base_url: str, policy: str) -> None:
    """Switch the fleet's routing policy and flush every worker's cache (a cold start)."""
    import httpx
    base = base_url.rstrip("/")
    r = httpx.post(f"{base}/fleet/router", json={"policy": policy}, timeout=60)
    if r.status_code != 200:
        raise RuntimeError(f"POST {base}/fleet/router {policy!r} failed: {r.status_code} {r.text}")
    r = httpx.post(f"{base}/flush_cache", timeout=60)
    if r.status_code != 200:
        raise RuntimeError(f"POST {base}/flush_cache failed: {r.status_code} {r.text.strip()}")
