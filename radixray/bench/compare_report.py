"""The result of ``radixray bench compare``: the comparison table, the ratios, the host and commit.

Pure functions over :func:`serve_metrics.summarize` dicts (one per sweep point and
server), except :func:`host_info` and :func:`git_commit`, which read this machine.
Ratios are always ``first server / second server`` (radixray / llama-server). With
several rounds (``--rounds``) the table holds each figure's median over the rounds and
each ratio's median over the rounds' own ratios (:func:`rounds_comparison`).
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess

# The instruction sets the CPU kernels of either server pick between.
KEY_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8",
             "amx_bf16")
METRICS = (  # (JSON key, summary key, scale)
    ("output_tok_s", "output_throughput", 1.0),
    ("median_tpot_ms", "median_tpot_ms", 1.0),
    ("median_ttft_s", "median_ttft_ms", 1e-3),
    ("max_itl_ms", "max_itl_ms", 1.0),
)
RATIO_NOTE = ("ratios are {a} / {b}: above 1 means {a} is higher, which is faster for tok/s "
              "and slower for TPOT, TTFT and ITL")


def parse_cpuinfo(text: str) -> dict:
    """CPU model name and which of :data:`KEY_FLAGS` a ``/proc/cpuinfo`` text lists."""
    model, flags = None, set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return {"cpu_model": model, "flags": {f: f in flags for f in KEY_FLAGS}}


def host_info() -> dict:
    """This machine: CPU model, CPU count, :data:`KEY_FLAGS`, OS and Python."""
    try:
        with open("/proc/cpuinfo") as f:
            info = parse_cpuinfo(f.read())
    except OSError:
        info = {"cpu_model": platform.processor() or None, "flags": {}}
    return {**info, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def git_commit() -> dict:
    """The radixray checkout's short commit and whether tracked files differ from it;
    ``{"commit": None}`` outside a git checkout."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*cmd: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", root, *cmd], capture_output=True, text=True,
                                 timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    if commit is None:
        return {"commit": None}
    return {"commit": commit, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def point_metrics(summary: dict) -> dict:
    """The :data:`METRICS` of one run (None where the run had no value)."""
    out = {}
    for key, source, scale in METRICS:
        value = summary.get(source)
        out[key] = None if value is None else value * scale
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def comparison(results: dict[str, list[dict]]) -> dict:
    """Per server and concurrency the :data:`METRICS`, and (with two servers) their ratios.

    ``results`` maps a server's label to its sweep summaries, in run order. Returns
    ``{"concurrencies": [...], "servers": {label: {conc: metrics}}, "ratios": {conc:
    {metric: first / second}}}``; concurrencies are the first server's, as strings
    (JSON keys), "inf" for no limit.
    """
    labels = list(results)
    concs = [str(s["max_concurrency"] or "inf") for s in results[labels[0]]]
    servers = {label: {str(s["max_concurrency"] or "inf"): point_metrics(s) for s in runs}
               for label, runs in results.items()}
    out = {"concurrencies": concs, "servers": servers, "ratios": {}}
    if len(labels) == 2:
        a, b = (servers[label] for label in labels)
        out["ratios"] = {c: {k: _ratio(a.get(c, {}).get(k), b.get(c, {}).get(k))
                             for k, _, _ in METRICS} for c in concs}
    return out


def _median(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def median_summaries(rounds: list[list[dict]]) -> list[dict]:
    """One server's sweep over several rounds -> one sweep of medians.

    ``rounds`` holds each round's summaries in sweep order (the same points every
    round). Every numeric field becomes its median over the rounds that have it,
    ``failed`` the sum; the label and concurrency are the first round's.
    """
    out = []
    for points in zip(*rounds):
        merged = dict(points[0])
        for key, value in points[0].items():
            if key == "failed":
                merged[key] = sum(p.get(key) or 0 for p in points)
            elif key != "max_concurrency" and isinstance(value, (int, float)) \
                    and not isinstance(value, bool):
                merged[key] = _median([p.get(key) for p in points])
        merged["rounds"] = len(points)
        out.append(merged)
    return out


def rounds_comparison(rounds: list[dict[str, list[dict]]]) -> dict:
    """:func:`comparison` over several rounds, each ``{label: summaries}`` measured side by
    side: each server's figures are medians over the rounds, each ratio the median of the
    rounds' own ratios (a pair measured minutes apart shares the host's phase), and
    ``"per_round"`` keeps every round's comparison."""
    per_round = [comparison(r) for r in rounds]
    labels = list(rounds[0])
    out = comparison({label: median_summaries([r[label] for r in rounds]) for label in labels})
    if out["ratios"]:
        out["ratios"] = {c: {k: _median([p["ratios"].get(c, {}).get(k) for p in per_round])
                             for k, _, _ in METRICS} for c in out["concurrencies"]}
    out["per_round"] = per_round
    return out


def rounds_rows(comp: dict, seeds: list[int], orders: list[list[str]]) -> list[list[str]]:
    """The per-round table: round, seed, which server ran first, then per concurrency
    both servers' output tok/s and their ratio."""
    labels = list(comp["servers"])
    header = ["round", "seed", "first"] + [f"c={c} tok/s ({' / '.join(labels)})"
                                           for c in comp["concurrencies"]]
    rows = [header]
    for n, (rc, seed, order) in enumerate(zip(comp["per_round"], seeds, orders), start=1):
        cells = [str(n), str(seed), order[0]]
        for c in comp["concurrencies"]:
            figs = [_num(rc["servers"][label].get(c, {}).get("output_tok_s"), 1) for label in labels]
            ratio = rc["ratios"].get(c, {}).get("output_tok_s") if rc["ratios"] else None
            cells.append(" / ".join(figs) + (f" = {_times(ratio)}" if rc["ratios"] else ""))
        rows.append(cells)
    return rows


def _num(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def table_rows(comp: dict) -> list[list[str]]:
    """The table: a header, one row per server, then the ratio row (two servers).

    Columns: server, then output tok/s at each concurrency (the first one with its p50
    TPOT in ms, the last with its p50 TTFT in s), then max ITL at the last one.
    """
    concs, labels = comp["concurrencies"], list(comp["servers"])
    first, last = concs[0], concs[-1]

    def notes(c: str) -> list[tuple[str, str, int]]:  # (metric, unit label, digits)
        return ([("median_tpot_ms", "p50 TPOT ms", 1)] if c == first else []) + \
               ([("median_ttft_s", "p50 TTFT s", 2)] if c == last else [])

    header = ["server"]
    for c in concs:
        units = "; ".join(unit for _, unit, _ in notes(c))
        header.append(f"c={c} tok/s" + (f" ({units})" if units else ""))
    header.append(f"c={last} max ITL ms")

    def row(name: str, values: dict, fmt) -> list[str]:
        cells = [name]
        for c in concs:
            m = values.get(c, {})
            extra = "; ".join(fmt(m.get(k), d) for k, _, d in notes(c))
            cells.append(fmt(m.get("output_tok_s"), 1) + (f" ({extra})" if extra else ""))
        cells.append(fmt(values.get(last, {}).get("max_itl_ms"), 0))
        return cells

    rows = [header] + [row(label, comp["servers"][label], _num) for label in labels]
    if comp["ratios"]:
        rows.append(row(f"{labels[0]} / {labels[1]}", comp["ratios"], lambda v, _d: _times(v)))
    return rows


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows[1:]])


def _flags(flags: dict) -> str:
    amx = [f for f in ("amx_tile", "amx_int8", "amx_bf16") if flags.get(f)]
    shown = [f for f in KEY_FLAGS if flags.get(f) and not f.startswith("amx")]
    return " ".join(shown + amx) + ("" if amx else " (no AMX)") if flags else "unknown"


def prompt_check_line(check: dict) -> str:
    """One line: the probe prompts' token counts as the client's tokenizer and each
    server's ``usage.prompt_tokens`` give them."""
    def fmt(counts):
        return ", ".join("not reported" if n is None else str(n) for n in counts)
    parts = [f"client tokenizer {fmt(check['client'])}"]
    parts += [f"{label} usage {fmt(counts)}" for label, counts in check["servers"].items()]
    line = "; ".join(parts)
    return line + ("" if check["agree"] else "  **the servers count these prompts differently**")


def markdown_report(report: dict) -> str:
    """The markdown file: title, table, ratio note, then host, commit, servers, workload,
    prompt-token check and the exact command."""
    labels = list(report["comparison"]["servers"])
    host, rev = report["host"], report["commit"]
    commit = "unknown (not a git checkout)" if rev.get("commit") is None else \
        rev["commit"] + (" with uncommitted changes" if rev.get("dirty") else "")
    comp = report["comparison"]
    lines = [f"# {' vs '.join(labels)}", "", markdown_table(table_rows(comp)), ""]
    if len(labels) == 2:
        lines += [RATIO_NOTE.format(a=labels[0], b=labels[1]) + ".", ""]
    if len(comp.get("per_round", [])) > 1:
        rounds = report["rounds"]
        lines += [f"Medians of {len(rounds)} rounds, each ratio the median of the rounds' own "
                  "ratios; the servers ran one after the other in every round, the first "
                  "one swapped each round:", "",
                  markdown_table(rounds_rows(comp, [r["seed"] for r in rounds],
                                             [r["order"] for r in rounds])), ""]
    lines += [f"- host: {host['cpu_model'] or 'unknown CPU'}, {host['cpu_count']} CPUs; "
              f"flags: {_flags(host['flags'])}",
              f"- commit: {commit}",
              f"- workload: {report['workload']}"]
    for label, server in report["servers"].items():
        how = f"started: `{' '.join(server['command'])}`" if server.get("command") \
            else f"at {server['url']} (started by the user)"
        failed = sum(s["failed"] for s in server["summaries"])
        version = f"; version: {server['version']}" if server.get("version") else ""
        lines.append(f"- {label}: {how}; model id `{server['model']}`; failed requests "
                     f"{failed}{version}")
    lines += [f"- prompt tokens of {len(report['prompt_check']['client'])} probe prompts: "
              f"{prompt_check_line(report['prompt_check'])}",
              f"- command: `{report['command']}`", ""]
    return "\n".join(lines)
