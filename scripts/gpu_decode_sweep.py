"""Decode and prefill speed of ``radixray.Engine`` over batch sizes, for the GPU check
(scripts/gpu_check.sh); nothing here needs Ray.

    python scripts/gpu_decode_sweep.py env --out DIR      # versions, imports, the device
    python scripts/gpu_decode_sweep.py run --model DIR --output DIR/bench_decode.json
    python scripts/gpu_decode_sweep.py report --out DIR   # DIR/gpu_check.json and a table

``run``: for each batch size B, B requests of ``--prompt-len`` random token ids decode
``--max-new-tokens`` tokens together (greedy, ignore_eos), after a short warm-up at the same
B. The step time is the engine's own timing: from the last request's first token to the
last finish (``meta_info`` first_token_latency / e2e_latency), over the steps between. Bytes
per step: every matmul weight once plus the KV of each request at its average context;
divided by the step time and by the GPU's peak HBM bandwidth (known for H200, H100 SXM,
A100 80GB) they give the bandwidth fraction. Prefill: ``--prefill-prompts`` prompts of
``--prefill-len`` tokens, wall time to their first tokens. The JSON is rewritten after
every figure, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import platform
import shutil
import sys
import time

# Peak HBM bandwidth (bytes/s) by device name: (all substrings that must appear, bandwidth).
PEAK_BANDWIDTH = [
    (("H200",), 4.8e12),
    (("H100", "HBM3"), 3.35e12),  # H100 SXM reports itself as "NVIDIA H100 80GB HBM3"
    (("H100", "SXM"), 3.35e12),
    (("A100", "80GB"), 2.0e12),
]

# the benchmark cannot run without these (the preflight fails)
REQUIRED = ["torch", "transformers", "tokenizers", "safetensors", "numpy", "jinja2", "yaml",
            "radixray.engine.engine", "radixray.bench.roofline"]
# the test steps need these (or skip): reported, the check goes on
FOR_TESTS = ["pytest", "httpx", "triton", "radixray.engine.attention.triton_backend",
             "radixray.kernels.triton_attention", "radixray.kernels.triton_moe"]
OPTIONAL = ["flashinfer", "ray"]  # flashinfer: its backend's tests; ray: not needed here


def peak_bandwidth(name: str) -> float | None:
    for needles, bandwidth in PEAK_BANDWIDTH:
        if all(n in name for n in needles):
            return bandwidth
    return None


def _write(path: str | None, data: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(data, f, indent=2)
        os.replace(path + ".tmp", path)


def _installed_version(name: str) -> str | None:
    import importlib.metadata
    import importlib.util
    if importlib.util.find_spec(name) is None:
        return None
    for dist in (name, f"{name}-python"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return "installed"


# ---- env ---------------------------------------------------------------------------------
def cmd_env(args) -> int:
    """Versions, the modules the check needs, the CUDA device; exit 1 when something the
    check needs is missing (``--allow-no-cuda``: a machine without a GPU, for --dry-run)."""
    import importlib
    info: dict = {"python": sys.version.split()[0], "executable": sys.executable,
                  "platform": platform.platform(), "modules": {}, "missing": []}
    info["missing_for_tests"] = []
    for name in REQUIRED + FOR_TESTS:
        try:
            mod = importlib.import_module(name)
            info["modules"][name] = getattr(mod, "__version__", "ok")
        except Exception as e:  # any import failure is reported the same way
            info["modules"][name] = None
            missing = info["missing"] if name in REQUIRED else info["missing_for_tests"]
            missing.append(f"{name}: {type(e).__name__}: {e}")
    for name in OPTIONAL:  # looked up, not imported (ray's import is slow)
        info["modules"][name] = _installed_version(name)
    # triton builds a small C launcher with the system compiler the first time it runs
    info["c_compiler"] = os.environ.get("CC") or next(
        (shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    try:
        import torch
        info["cuda_available"] = torch.cuda.is_available()
        info["torch_cuda"] = torch.version.cuda
        if info["cuda_available"]:
            info["gpu"] = torch.cuda.get_device_name(0)
            props = torch.cuda.get_device_properties(0)
            info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
            info["capability"] = f"{props.major}.{props.minor}"
            info["peak_bandwidth_Bps"] = peak_bandwidth(info["gpu"])
    except Exception as e:
        info["cuda_available"] = False
        info["cuda_error"] = repr(e)
    if args.out:
        _write(os.path.join(args.out, "env.json"), info)
    for name, version in info["modules"].items():
        absent = ("not installed (optional)" if name in OPTIONAL else
                  "MISSING (the test steps fail or skip)" if name in FOR_TESTS else "MISSING")
        print(f"  {name:<42} {version if version is not None else absent}")
    print(f"  {'C compiler (triton)':<42} "
          f"{info['c_compiler'] or 'MISSING (the triton kernels cannot compile)'}")
    print(f"  cuda: {info.get('cuda_available')} {info.get('gpu', '')}")
    for line in info["missing"] + info["missing_for_tests"]:
        print(f"missing: {line}", file=sys.stderr)
    ok = not info["missing"] and (info.get("cuda_available") or args.allow_no_cuda)
    if not info.get("cuda_available") and not args.allow_no_cuda:
        print("no CUDA device: the check needs one (--dry-run checks the steps without)",
              file=sys.stderr)
    return 0 if ok else 1


# ---- run ---------------------------------------------------------------------------------
def _decode(eng, batch: int, prompt_len: int, new_tokens: int, vocab: int, seed: int) -> dict:
    from radixray.bench import random_token_prompts
    prompts = random_token_prompts(batch, prompt_len, vocab, seed)
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - t0
    eng.flush_cache()
    lengths = {len(o["output_ids"]) for o in outs}
    if lengths != {new_tokens}:
        raise RuntimeError(f"batch {batch}: output lengths {sorted(lengths)}, want {new_tokens}")
    first = max(o["meta_info"]["first_token_latency"] for o in outs)
    last = max(o["meta_info"]["e2e_latency"] for o in outs)
    return {"step_s": (last - first) / (new_tokens - 1), "ttft_s": first, "wall_s": wall}


def _prefill(eng, n: int, length: int, vocab: int, seed: int) -> float:
    from radixray.bench import random_token_prompts
    prompts = random_token_prompts(n, length, vocab, seed)
    t0 = time.perf_counter()
    eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1, "temperature": 0.0})
    seconds = time.perf_counter() - t0
    eng.flush_cache()
    return seconds


def _device_name(device: str) -> str:
    import torch
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine() or "cpu"


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def cmd_run(args) -> int:
    import torch

    from radixray import Engine
    from radixray.bench.roofline import ModelCost

    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    new = args.max_new_tokens
    if new < 2:
        raise SystemExit("--max-new-tokens must be at least 2 (the step time spans the tokens "
                         "after the first)")
    pool = (max(batches) * (args.prompt_len + new + 8)
            + max(args.prefill_prompts, 1) * (args.prefill_len + 8) + 256)
    options = {"model": args.model, "device": args.device, "dtype": args.dtype,
               "attention_backend": args.attention_backend, "max_total_tokens": pool,
               "max_running_requests": max(batches),
               "context_length": max(args.context_length, args.prompt_len + new + 8,
                                      args.prefill_len + 8)}
    if args.disable_cuda_graph:
        options["disable_cuda_graph"] = True
    if args.cuda_graph_max_bs is not None:
        options["cuda_graph_max_bs"] = args.cuda_graph_max_bs
    gpu = _device_name(args.device)
    peak = peak_bandwidth(gpu) if args.device.startswith("cuda") else None
    result: dict = {"label": args.label, "device": args.device, "gpu": gpu,
                    "peak_bandwidth_Bps": peak, "engine_options": options,
                    "prompt_len": args.prompt_len, "max_new_tokens": new,
                    "torch": torch.__version__, "decode": [], "prefill": None}
    print(f"[sweep {args.label}] {gpu}: starting the engine with {options}", flush=True)
    t0 = time.perf_counter()
    with Engine(**options) as eng:
        _sync(args.device)
        result["engine_start_s"] = round(time.perf_counter() - t0, 2)
        runner = eng.runner
        facts = eng.model_facts()
        cost = ModelCost.of(facts.module, facts.kv_bytes_per_token)
        vocab = eng.limits.vocab_size
        result["attention_backend"] = getattr(runner.attn_backend, "name", None)
        graphs = getattr(runner, "decode_graphs", None)  # engine/executor/cuda_graph.py
        result["cuda_graph_sizes"] = list(getattr(graphs, "sizes", []) or []) or None
        result["model"] = {"dtype": str(facts.dtype).removeprefix("torch."),
                           "params": sum(p.numel() for p in facts.module.parameters()),
                           "weight_bytes": cost.weight_bytes,
                           "kv_bytes_per_token": cost.kv_bytes_per_token}
        _write(args.output, result)
        avg_ctx = args.prompt_len + new / 2
        for i, b in enumerate(batches):
            _decode(eng, b, args.prompt_len, min(new, 4), vocab, seed=1000 + i)  # warm-up
            runs = [_decode(eng, b, args.prompt_len, new, vocab, seed=10 * i + r)
                    for r in range(args.repeats)]
            best = sorted(runs, key=lambda r: r["step_s"])[len(runs) // 2]  # the median
            step = best["step_s"]
            read = cost.weight_bytes + b * avg_ctx * cost.kv_bytes_per_token
            row = {"batch": b, "step_ms": round(step * 1e3, 3),
                   "tokens_per_s": round(b / step, 1), "ttft_ms": round(best["ttft_s"] * 1e3, 1),
                   "wall_s": round(best["wall_s"], 3),
                   "wall_ms_per_output_token": round(best["wall_s"] / new * 1e3, 3),
                   "bytes_per_step": int(read), "bytes_per_s": read / step,
                   "bandwidth_fraction": (read / step / peak) if peak else None,
                   # the last step ran the whole batch: through a CUDA graph or not
                   "graphed": getattr(runner, "last_step_graphed", None)}
            result["decode"].append(row)
            frac = f" {100 * row['bandwidth_fraction']:.1f}% of peak" if peak else ""
            print(f"[sweep {args.label}] batch {b:>4}: step {row['step_ms']:8.3f} ms "
                  f"{row['tokens_per_s']:10.1f} tok/s {read / step / 1e9:8.1f} GB/s{frac}",
                  flush=True)
            _write(args.output, result)
        one = next((r for r in result["decode"] if r["batch"] == 1), None)
        if one:
            result["batch1_bandwidth"] = {
                "weight_bytes": cost.weight_bytes,
                "kv_bytes_read": int(avg_ctx * cost.kv_bytes_per_token),
                "step_ms": one["step_ms"], "bytes_per_s": one["bytes_per_s"],
                "peak_bandwidth_Bps": peak, "fraction": one["bandwidth_fraction"]}
        if args.prefill_prompts > 0:
            _prefill(eng, 1, args.prefill_len, vocab, seed=7)  # warm-up
            seconds = _prefill(eng, args.prefill_prompts, args.prefill_len, vocab, seed=8)
            tokens = args.prefill_prompts * args.prefill_len
            result["prefill"] = {"prompts": args.prefill_prompts, "prompt_len": args.prefill_len,
                                 "seconds": round(seconds, 4),
                                 "tokens_per_s": round(tokens / seconds, 1)}
            print(f"[sweep {args.label}] prefill {args.prefill_prompts} x {args.prefill_len}: "
                  f"{tokens / seconds:.0f} tok/s", flush=True)
        if args.device.startswith("cuda"):
            result["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    result["complete"] = True
    _write(args.output, result)
    return 0


# ---- report ------------------------------------------------------------------------------
def _pytest_summary(log: str) -> str:
    """The last pytest summary line of ``log`` ("12 passed, 3 skipped in 40.1s"), or ''."""
    try:
        with open(log, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    words = ("passed", "failed", "error", "skipped", "no tests ran", "deselected")
    for line in reversed(lines):
        if any(w in line for w in words) and " in " in line:
            return line.strip("= ").strip()
    return ""


def _last_line(log: str) -> str:
    try:
        with open(log, errors="replace") as f:
            lines = [line.strip() for line in f.read().splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:100] if lines else ""


def cmd_report(args) -> int:
    out = args.out
    report: dict = {"dry_run": args.dry_run, "gpu": None, "env": None, "steps": [],
                    "bench": {}}
    env_path = os.path.join(out, "env.json")
    if os.path.exists(env_path):
        with open(env_path) as f:
            report["env"] = json.load(f)
        report["gpu"] = report["env"].get("gpu")
    smi = os.path.join(out, "nvidia-smi.txt")
    if os.path.exists(smi):
        with open(smi) as f:
            report["nvidia_smi"] = f.read().strip()
        if report["gpu"] is None and report["nvidia_smi"].startswith("GPU 0:"):
            report["gpu"] = report["nvidia_smi"].splitlines()[0].split(":", 1)[1].split("(")[0].strip()
    steps_path = os.path.join(out, "steps.tsv")
    if os.path.exists(steps_path):
        with open(steps_path, newline="") as f:
            for name, status, rc, seconds, limit, command in csv.reader(f, delimiter="\t"):
                log = os.path.join(out, f"{name}.log")
                summary = _pytest_summary(log) or (_last_line(log) if status != "pass" else "")
                report["steps"].append({
                    "name": name, "status": status, "rc": int(rc) if rc else None,
                    "seconds": float(seconds), "limit_s": int(limit), "summary": summary,
                    "log": log if os.path.exists(log) else None, "command": command})
    for path in sorted(glob.glob(os.path.join(out, "bench_*.json"))):
        with open(path) as f:
            report["bench"][os.path.basename(path)[len("bench_"):-len(".json")]] = json.load(f)
    report["total_s"] = round(sum(s["seconds"] for s in report["steps"]), 1)
    _write(os.path.join(out, "gpu_check.json"), report)
    print_table(report)
    print(f"\nwritten: {os.path.join(out, 'gpu_check.json')}")
    return 0


def print_table(report: dict) -> None:
    print(f"\n=== GPU check{' (dry run)' if report['dry_run'] else ''}: "
          f"{report['gpu'] or 'no GPU'} ===")
    print(f"{'step':<16} {'status':<12} {'seconds':>8} {'limit':>6}  summary")
    for s in report["steps"]:
        status = s["status"] if s["rc"] in (None, 0) else f"{s['status']} ({s['rc']})"
        print(f"{s['name']:<16} {status:<12} {s['seconds']:>8.1f} {s['limit_s']:>6}  "
              f"{s['summary']}")
    print(f"{'total':<16} {'':<12} {report['total_s']:>8.1f}")
    benches = report["bench"]
    main = benches.get("decode")
    if not main:
        print("\nno decode benchmark results")
        return
    others = {k: v for k, v in benches.items() if k != "decode"}
    backend = main.get("attention_backend")
    sizes = main.get("cuda_graph_sizes")
    graphs = f"CUDA graphs up to batch {sizes[-1]}" if sizes else "no CUDA graphs"
    print(f"\ndecode, {main.get('model', {}).get('params', 0) / 1e9:.2f}B params "
          f"({main.get('model', {}).get('dtype')}), attention {backend}, {graphs}, prompt "
          f"{main['prompt_len']} + {main['max_new_tokens']} new tokens; engine start "
          f"{main.get('engine_start_s', '?')} s")
    head = (f"{'batch':>5} {'graph':>5} {'step ms':>9} {'tok/s':>10} {'GB/s':>8} {'% peak':>7} "
            f"{'TTFT ms':>9}")
    for stem, other in others.items():
        head += f" {('step ms ' + (other.get('label') or stem))[:20]:>20}"
    print(head)
    other_rows = {k: {r["batch"]: r for r in v.get("decode", [])} for k, v in others.items()}
    for r in main["decode"]:
        frac = r.get("bandwidth_fraction")
        pct = f"{100 * frac:.1f}%" if frac is not None else "-"
        graphed = {True: "yes", False: "no"}.get(r.get("graphed"), "-")
        line = (f"{r['batch']:>5} {graphed:>5} {r['step_ms']:>9.3f} {r['tokens_per_s']:>10.1f} "
                f"{r['bytes_per_s'] / 1e9:>8.1f} {pct:>7} {r['ttft_ms']:>9.1f}")
        for k in others:
            o = other_rows[k].get(r["batch"])
            cell = f"{o['step_ms']:.3f}" if o else "-"
            line += f" {cell:>20}"
        print(line)
    b1 = main.get("batch1_bandwidth")
    if b1:
        peak = b1["peak_bandwidth_Bps"]
        tail = (f" = {100 * b1['fraction']:.1f}% of {peak / 1e12:.2f} TB/s peak" if peak else
                " (peak bandwidth unknown for this device)")
        print(f"batch 1: ({b1['weight_bytes'] / 1e9:.3f} GB weights + "
              f"{b1['kv_bytes_read'] / 1e6:.2f} MB KV) / {b1['step_ms']:.3f} ms = "
              f"{b1['bytes_per_s'] / 1e9:.1f} GB/s{tail}")
    p = main.get("prefill")
    if p:
        print(f"prefill {p['prompts']} x {p['prompt_len']} tokens: {p['tokens_per_s']:.0f} tok/s "
              f"({p['seconds']:.3f} s)")
    if not main.get("complete"):
        print("(the decode benchmark stopped early: its figures are partial)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("env", help="versions, needed imports, the CUDA device")
    e.add_argument("--out", help="write env.json here")
    e.add_argument("--allow-no-cuda", action="store_true")
    e.set_defaults(func=cmd_env)
    r = sub.add_parser("run", help="the decode/prefill sweep")
    r.add_argument("--model", required=True, help="a Hugging Face model folder")
    r.add_argument("--device", default="cuda")
    r.add_argument("--dtype", default="auto")
    r.add_argument("--attention-backend", default="auto")
    r.add_argument("--disable-cuda-graph", action="store_true")
    r.add_argument("--cuda-graph-max-bs", type=int, default=None)
    r.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    r.add_argument("--prompt-len", type=int, default=128)
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--repeats", type=int, default=1, help="runs per batch size (median)")
    r.add_argument("--prefill-len", type=int, default=2048)
    r.add_argument("--prefill-prompts", type=int, default=8, help="0: no prefill figure")
    r.add_argument("--context-length", type=int, default=4096,
                   help="the engine's longest sequence (bounds its per-request tables)")
    r.add_argument("--label", default="default")
    r.add_argument("--output", help="the JSON to write")
    r.set_defaults(func=cmd_run)
    rep = sub.add_parser("report", help="gather a check's folder into gpu_check.json + a table")
    rep.add_argument("--out", required=True)
    rep.add_argument("--dry-run", action="store_true")
    rep.set_defaults(func=cmd_report)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
