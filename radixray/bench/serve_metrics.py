"""Serving metrics: pure functions over per-request records (no I/O, no clocks).

Conventions (the same as SGLang's and vLLM's serving benchmarks):

- Times in a :class:`RequestRecord` are seconds; summaries report milliseconds.
- Only successful requests count towards tokens, latencies and throughput.
- TPOT of one request = (latency - TTFT) / (output_tokens - 1), defined only for
  requests with more than one output token.
- ITL values of all requests are pooled before taking statistics.
- Percentiles interpolate linearly between order statistics (numpy's default).
- Concurrency = sum of E2E latencies / benchmark duration (the mean number of
  requests in flight).
- Goodput = requests meeting every given SLO per second; a request without a
  TPOT (one output token) meets a TPOT SLO trivially, and an absent SLO is met.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

BANNER = " Serving Benchmark Result "


@dataclass
class RequestRecord:
    """One measured request. ``ttft``, ``itl`` and ``latency`` are seconds from the send.

    ``cached_tokens`` is None when the server did not report it; ``error`` holds
    the reason of a failed request. ``session_id`` and ``turn`` place a request
    inside a multi-turn conversation.
    """

    index: int
    label: str = ""
    concurrency: int | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None
    success: bool = False
    error: str | None = None
    session_id: str | None = None
    turn: int = 0

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first; None unless successful with >1 output token."""
        if not self.success or self.output_tokens <= 1 or self.ttft is None or self.latency is None:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def meets_slo(self, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
        """Successful, and within both SLOs (an absent SLO, or an absent TPOT, is met)."""
        if not self.success:
            return False
        if slo_ttft_ms is not None and (self.ttft is None or self.ttft * 1000 > slo_ttft_ms):
            return False
        tpot = self.tpot
        return slo_tpot_ms is None or tpot is None or tpot * 1000 <= slo_tpot_ms

    def to_json(self) -> dict:
        """A JSON-ready dict of every field plus ``tpot`` (seconds)."""
        return {**asdict(self), "tpot": self.tpot}


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats_ms(prefix: str, seconds: list[float]) -> dict:
    ms = [s * 1000.0 for s in seconds]
    return {f"mean_{prefix}_ms": sum(ms) / len(ms) if ms else None,
            f"median_{prefix}_ms": percentile(ms, 50),
            f"p99_{prefix}_ms": percentile(ms, 99)}


def summarize(records: list[RequestRecord], duration: float, *, label: str = "",
              request_rate: float = math.inf, max_concurrency: int | None = None,
              slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> dict:
    """Aggregate ``records`` of one run that took ``duration`` seconds into a flat dict.

    Keys ending in ``_ms`` are milliseconds; throughputs are per second of
    ``duration``. ``total_cached_tokens`` and ``cache_hit_rate`` are None when no
    successful request reported cached tokens; the hit rate divides by the input
    tokens of the reporting requests only. ``goodput`` is None when neither SLO is given.
    """
    ok = [r for r in records if r.success]
    dur = duration if duration > 0 else math.nan
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    latencies = [r.latency for r in ok if r.latency is not None]
    reporting = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens for r in reporting) if reporting else None
    reporting_in = sum(r.prompt_tokens for r in reporting)
    out = {
        "label": label,
        "request_rate": request_rate,
        "max_concurrency": max_concurrency,
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "input_throughput": total_in / dur,
        "output_throughput": total_out / dur,
        "total_throughput": (total_in + total_out) / dur,
        "concurrency": sum(latencies) / dur,
        **_stats_ms("e2e_latency", latencies),
        **_stats_ms("ttft", [r.ttft for r in ok if r.ttft is not None]),
        **_stats_ms("tpot", [t for t in (r.tpot for r in ok) if t is not None]),
        **_stats_ms("itl", [g for r in ok for g in r.itl]),
        "max_itl_ms": max((g * 1000.0 for r in ok for g in r.itl), default=None),
        "total_cached_tokens": cached,
        "cache_hit_rate": cached / reporting_in if reporting and reporting_in else None,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "goodput": None,
    }
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        out["goodput"] = sum(r.meets_slo(slo_ttft_ms, slo_tpot_ms) for r in ok) / dur
    return out


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.2f}"
    return str(value)


def format_summary(s: dict) -> str:
    """The result block of one run, laid out like SGLang's bench_serving."""
    def row(name, value):
        return f"{name:<40} {_fmt(value):<10}"

    def section(title):
        return f"{title:-^50}"

    lines = [f"{BANNER:=^50}",
             row("Backend:", s["label"] or "openai"),
             row("Traffic request rate:", s["request_rate"]),
             row("Max request concurrency:",
                 "not set" if s["max_concurrency"] is None else s["max_concurrency"]),
             row("Successful requests:", s["completed"]),
             row("Failed requests:", s["failed"]),
             row("Benchmark duration (s):", s["duration_s"]),
             row("Total input tokens:", s["total_input_tokens"]),
             row("Total generated tokens:", s["total_output_tokens"]),
             row("Request throughput (req/s):", s["request_throughput"]),
             row("Input token throughput (tok/s):", s["input_throughput"]),
             row("Output token throughput (tok/s):", s["output_throughput"]),
             row("Total token throughput (tok/s):", s["total_throughput"]),
             row("Concurrency:", s["concurrency"])]
    if s["total_cached_tokens"] is not None:
        lines += [row("Total cached tokens:", s["total_cached_tokens"]),
                  row("Cache hit rate (cached/input):", s["cache_hit_rate"])]
    if s.get("server_hit_rate") is not None:
        lines += [row("Server-side hit rate (counters):", s["server_hit_rate"]),
                  row("Requests by worker:", ", ".join(
                      f"{w} {n}" for w, n in s["requests_by_worker"].items()) or "-")]
    if s["goodput"] is not None:
        slo = ", ".join(f"{k} <= {s[f'slo_{k}_ms']:g} ms" for k in ("ttft", "tpot")
                        if s[f"slo_{k}_ms"] is not None)
        lines += [row("SLOs:", slo), row("Goodput (req/s):", s["goodput"])]
    for title, key in (("End-to-End Latency", "e2e_latency"), ("Time to First Token", "ttft"),
                       ("Time per Output Token (excl. 1st token)", "tpot"),
                       ("Inter-Token Latency", "itl")):
        name = {"e2e_latency": "E2E Latency"}.get(key, key.upper())
        lines += [section(title),
                  row(f"Mean {name} (ms):", s[f"mean_{key}_ms"]),
                  row(f"Median {name} (ms):", s[f"median_{key}_ms"]),
                  row(f"P99 {name} (ms):", s[f"p99_{key}_ms"])]
    lines += [row("Max ITL (ms):", s["max_itl_ms"]), "=" * 50]
    return "\n".join(lines)


SWEEP_COLUMNS = (("label", "label"), ("conc", "max_concurrency"), ("req/s", "request_throughput"),
                 ("out tok/s", "output_throughput"), ("p50 TTFT ms", "median_ttft_ms"),
                 ("p99 TTFT ms", "p99_ttft_ms"), ("p50 TPOT ms", "median_tpot_ms"),
                 ("goodput", "goodput"))


def format_sweep_table(summaries: list[dict]) -> str:
    """One row per run: label, concurrency, req/s, output tok/s, p50/p99 TTFT, p50 TPOT, goodput."""
    rows = [[h for h, _ in SWEEP_COLUMNS]]
    rows += [[_fmt(s[k]) if k != "max_concurrency" or s[k] is not None else "inf"
              for _, k in SWEEP_COLUMNS] for s in summaries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(SWEEP_COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)
