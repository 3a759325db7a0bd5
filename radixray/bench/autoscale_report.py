"""``bench autoscale``'s result: the table (one row per fleet) and the plot (workers and
TTFT over time). Pure functions of the fleets' trace summaries
(:func:`radixray.bench.load_steps.run_steps`), no I/O but the PNG."""

from __future__ import annotations

COLUMNS = (("fleet", "fleet"), ("burst p99 TTFT s", "burst_p99_ttft_s"),
           ("burst 503s", "burst_503"), ("burst SLO met", "burst_slo_met"),
           ("other failures", "other_failures"), ("out tok/s", "output_tok_s"),
           ("worker-s", "worker_seconds"), ("held worker-s", "worker_seconds_held"),
           ("max workers", "max_workers"),
           ("up/down", "decisions"))


def burst_phase(summary: dict) -> dict:
    """The trace's phase with the highest rate (the first of equals)."""
    return max(summary["phases"], key=lambda p: p["rate"])


def _max_workers(summary: dict) -> str | None:
    total, by_role = summary["max_workers"], summary["max_workers_by_role"]
    if total is None:
        return None
    if set(by_role) <= {"unified"}:
        return str(total)
    return f"{total} (" + " ".join(f"{r[0].upper()}{n}" for r, n in sorted(
        by_role.items(), key=lambda kv: kv[0] != "prefill")) + ")"


def table_rows(fleets: list[dict]) -> list[dict]:
    """Per fleet: the burst phase's p99 TTFT (s), 503s and share of its requests within
    both SLOs; the whole trace's other failures (not 503), output tok/s, worker-seconds,
    most workers (per role for prefill-decode) and scaling decisions up/down."""
    rows = []
    for s in fleets:
        burst = burst_phase(s)
        met = None
        if burst["goodput"] is not None and burst["num_requests"]:
            met = burst["goodput"] * burst["duration_s"] / burst["num_requests"]
        p99 = burst["p99_ttft_ms"]
        ups = sum(v for k, v in s["decisions"].items() if k.endswith(":up"))
        downs = sum(v for k, v in s["decisions"].items() if k.endswith(":down"))
        rows.append({"fleet": s["fleet"], "burst": burst["step"],
                     "burst_p99_ttft_s": None if p99 is None else p99 / 1000,
                     "burst_503": burst["rejected_503"], "burst_slo_met": met,
                     "burst_requests": burst["num_requests"],
                     "other_failures": sum(p["other_failures"] for p in s["phases"]),
                     "rejected_503": sum(p["rejected_503"] for p in s["phases"]),
                     "output_tok_s": s["output_throughput"],
                     "worker_seconds": s["worker_seconds"],
                     "worker_seconds_held": s.get("worker_seconds_held"),
                     "max_workers": _max_workers(s),
                     "decisions": f"{ups}/{downs}" if s["decisions"] else None})
    return rows


def _cell(key: str, value) -> str:
    if value is None:
        return "n/a"
    if key == "burst_slo_met":
        return f"{100 * value:.0f}%"
    if key in ("burst_p99_ttft_s", "output_tok_s"):
        return f"{value:.2f}" if key == "burst_p99_ttft_s" else f"{value:.1f}"
    if key in ("worker_seconds", "worker_seconds_held"):
        return f"{value:.0f}"
    return str(value)


def format_table(rows: list[dict]) -> str:
    """The rows as aligned text, one line per fleet."""
    cells = [[h for h, _ in COLUMNS]] + [[_cell(k, r[k]) for _, k in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells)


def plot_autoscale(fleets: list[dict], path: str) -> str:
    """Write a PNG to ``path`` and return it: one column per pair (unified, pd); on top the
    fleets' workers over time (starting or ready, solid; an autoscaled fleet's desired,
    dotted, and ready, dashed), below each request's TTFT
    at its arrival time (log scale) with 503s as crosses along the top; the burst phase
    shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    kinds = list(dict.fromkeys(s["kind"] for s in fleets))
    fig, axes = plt.subplots(2, len(kinds), figsize=(7 * len(kinds), 7), squeeze=False,
                             sharex="col")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for col, kind in enumerate(kinds):
        top, bottom = axes[0][col], axes[1][col]
        mine = [s for s in fleets if s["kind"] == kind]
        burst = burst_phase(mine[0])
        for ax in (top, bottom):
            ax.axvspan(burst["start_s"], burst["end_s"], color="0.92", zorder=0)
            ax.grid(True, alpha=0.3)
        ttfts = [p["ttft_s"] for s in mine for p in s["requests"] if p["ttft_s"]]
        ceiling = max(ttfts, default=1.0) * 1.5
        for color, s in zip(colors, mine):
            line = s["fleet_timeline"]
            ts = [x["t"] for x in line if x["current"]]
            top.step(ts, [sum(x["current"].values()) for x in line if x["current"]],
                     where="post", color=color, label=f"{s['fleet']} workers")
            if any(s["decisions"].values()):  # a fleet that scaled: desired and ready too
                top.step(ts, [sum(x["desired"].values()) for x in line if x["current"]],
                         where="post", color=color, linestyle=":", label=f"{s['fleet']} desired")
                ready = [x for x in line if x.get("states")]
                top.step([x["t"] for x in ready], [x["states"].get("ready", 0) for x in ready],
                         where="post", color=color, linestyle="--", alpha=0.6,
                         label=f"{s['fleet']} ready")
            ok = [p for p in s["requests"] if p["ttft_s"]]
            bottom.plot([p["t"] for p in ok], [p["ttft_s"] for p in ok], ".", color=color,
                        alpha=0.6, label=f"{s['fleet']} TTFT")
            rejected = [p["t"] for p in s["requests"] if p["outcome"] == "503"]
            if rejected:
                bottom.plot(rejected, [ceiling] * len(rejected), "x", color=color,
                            label=f"{s['fleet']} 503 ({len(rejected)})")
        top.set_ylabel("workers (starting or ready)")
        top.set_title(f"{kind}: trace {mine[0]['load_steps']} (burst shaded)", fontsize=10)
        top.legend(fontsize=8)
        bottom.set_yscale("log")
        bottom.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        bottom.set_ylabel("TTFT (s, log scale)")
        bottom.set_xlabel("arrival time (s from the trace's start)")
        bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
