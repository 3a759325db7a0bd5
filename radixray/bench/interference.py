"""What ``bench serve --dataset interference`` adds to a run's summary: TTFT and ITL split
between the short chats and the long prompts, the KV transfer rate of a disaggregated
fleet, and that rate as a share of the machine's loopback TCP rate measured in the same
invocation (``--loopback-tcp``); and the side-by-side table of the targets."""

from __future__ import annotations

from radixray.bench.serve_metrics import RequestRecord, _fmt, _stats_ms

TABLE = (("label", "label"), ("out tok/s", "output_throughput"),
         ("p50 TTFT short ms", "median_ttft_ms_short"), ("p99 TTFT short ms", "p99_ttft_ms_short"),
         ("p50 TTFT long ms", "median_ttft_ms_long"), ("p50 ITL ms", "median_itl_ms_short"),
         ("p99 ITL ms", "p99_itl_ms_short"), ("max ITL ms", "max_itl_ms"),
         ("KV GB/s", "kv_transfer_gb_s"), ("vs loopback", "kv_transfer_vs_loopback"))


def class_stats(records: list[RequestRecord], groups: dict[int, int]) -> dict:
    """TTFT of each class and ITL of the short chats (``groups``: item index -> 1 long,
    0 short), as ``median_ttft_ms_long`` and so on."""
    out = {}
    for name, g in (("short", 0), ("long", 1)):
        ok = [r for r in records if r.success and groups.get(r.index) == g]
        ttft = _stats_ms("ttft", [r.ttft for r in ok if r.ttft is not None])
        itl = _stats_ms("itl", [x for r in ok for x in r.itl])
        out.update({f"{k}_{name}": v for k, v in {**ttft, **itl}.items()})
    return out


def transfer_fields(summary: dict, loopback_rate: float | None) -> dict:
    """The run's KV transfer rate in GB/s and as a share of ``loopback_rate`` (bytes/s; the
    higher of the rates measured before and after the runs, so the share is not flattered
    by a slow loopback measurement)."""
    rate = summary.get("kv_transfer_rate")
    return {"loopback_tcp_gb_s": loopback_rate / 1e9 if loopback_rate else None,
            "kv_transfer_gb_s": rate / 1e9 if rate else None,
            "kv_transfer_vs_loopback": rate / loopback_rate if rate and loopback_rate else None}


def format_table(summaries: list[dict]) -> str:
    rows = [[h for h, _ in TABLE]] + [[_fmt(s.get(k)) for _, k in TABLE] for s in summaries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(TABLE))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    loop = next((s["loopback_tcp_gb_s"] for s in summaries if s.get("loopback_tcp_gb_s")), None)
    if loop:
        lines.append(f"loopback TCP (plain sockets, this machine, this run; the higher of the "
                     f"rates before and after): {loop:.2f} GB/s")
    return "\n".join(lines)
