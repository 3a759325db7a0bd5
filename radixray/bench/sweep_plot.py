"""The concurrency-sweep chart of ``radixray bench serve --sweep``: TTFT against output throughput."""

from __future__ import annotations

KNEE_GAIN = 0.10
KNEE_RULE = "knee = last concurrency whose throughput gain over the previous point is >= 10%"


def find_knee(throughputs: list[float], min_gain: float = KNEE_GAIN) -> int:
    """Index of the knee of a sweep ordered by rising concurrency.

    The knee is the last point whose throughput exceeds the previous point's by at
    least ``min_gain`` (a fraction); past it, more concurrency mostly buys
    latency. Index 0 when no step gains that much; -1 for an empty sweep.
    """
    knee = 0 if throughputs else -1
    for i in range(1, len(throughputs)):
        prev, cur = throughputs[i - 1], throughputs[i]
        if (cur >= prev * (1 + min_gain)) if prev > 0 else cur > 0:
            knee = i
    return knee


def plot_sweep(summaries: list[dict], path: str) -> str:
    """Write a PNG to ``path`` and return ``path``.

    ``summaries`` are :func:`serve_metrics.summarize` dicts. One p50 line (solid)
    and one p99 line (dashed) of TTFT per label, x = output token throughput,
    y = TTFT in ms on a log scale; every point is annotated with its max
    concurrency and each label's knee (:func:`find_knee`) is circled.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(8, 5.5))
    labels = list(dict.fromkeys(s["label"] for s in summaries))
    for color, label in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4, labels):
        runs = sorted((s for s in summaries if s["label"] == label),
                      key=lambda s: s["max_concurrency"] or float("inf"))
        runs = [s for s in runs if s["median_ttft_ms"] is not None]
        if not runs:
            continue
        xs = [s["output_throughput"] for s in runs]
        p50 = [s["median_ttft_ms"] for s in runs]
        p99 = [s["p99_ttft_ms"] for s in runs]
        ax.plot(xs, p50, "o-", color=color, label=f"{label} p50 TTFT")
        ax.plot(xs, p99, "s--", color=color, alpha=0.7, label=f"{label} p99 TTFT")
        for x, y, s in zip(xs, p50, runs):
            conc = s["max_concurrency"] if s["max_concurrency"] is not None else "inf"
            ax.annotate(f"c={conc}", (x, y), textcoords="offset points", xytext=(4, 6), fontsize=8)
        k = find_knee(xs)
        ax.plot([xs[k]], [p50[k]], "o", markersize=16, markerfacecolor="none",
                markeredgecolor=color, markeredgewidth=2, label=f"{label} knee")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xlabel("output token throughput (tok/s)")
    ax.set_ylabel("TTFT (ms, log scale)")
    ax.set_title(f"Concurrency sweep\n{KNEE_RULE}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
