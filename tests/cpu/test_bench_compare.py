"""``radixray bench compare``: the table and its ratios, the flags' errors, and whole runs.

The fast run sends the sweep to the naive server (a real OpenAI-compatible server of
this repo) given as both URLs; the slow one lets the command start ``radixray serve``
itself and a stand-in llama-server binary (a script that takes llama-server's flags and
serves the naive server on the port it was given), one after the other.
"""

import argparse
import json
import os
import stat
import sys

import httpx
import pytest
from serving_helpers import uvicorn_in_thread

from radixray.bench import compare, compare_report, launch


def summary(label, conc, tok_s, tpot_ms, ttft_ms, max_itl_ms, failed=0):
    return {"label": label, "max_concurrency": conc, "output_throughput": tok_s,
            "median_tpot_ms": tpot_ms, "median_ttft_ms": ttft_ms, "max_itl_ms": max_itl_ms,
            "failed": failed}


def test_table_columns_values_and_ratios():
    comp = compare_report.comparison({
        "radixray": [summary("radixray", 1, 40.0, 25.0, 100.0, 60.0),
                     summary("radixray", 8, 120.0, 60.0, 900.0, 300.0),
                     summary("radixray", 32, 200.0, 150.0, 4500.0, 1200.0)],
        "llama-server": [summary("llama-server", 1, 50.0, 20.0, 80.0, 30.0),
                         summary("llama-server", 8, 100.0, 75.0, 600.0, 200.0),
                         summary("llama-server", 32, 100.0, 300.0, 9000.0, 2400.0)]})
    assert comp["ratios"]["32"] == {"output_tok_s": 2.0, "median_tpot_ms": 0.5,
                                    "median_ttft_s": 0.5, "max_itl_ms": 0.5}
    assert comp["ratios"]["1"]["output_tok_s"] == pytest.approx(0.8)
    assert comp["servers"]["radixray"]["32"]["median_ttft_s"] == 4.5
    rows = compare_report.table_rows(comp)
    assert rows == [
        ["server", "c=1 tok/s (p50 TPOT ms)", "c=8 tok/s", "c=32 tok/s (p50 TTFT s)",
         "c=32 max ITL ms"],
        ["radixray", "40.0 (25.0)", "120.0", "200.0 (4.50)", "1,200"],
        ["llama-server", "50.0 (20.0)", "100.0", "100.0 (9.00)", "2,400"],
        ["radixray / llama-server", "0.80x (1.25x)", "1.20x", "2.00x (0.50x)", "0.50x"]]
    md = compare_report.markdown_table(rows).splitlines()
    assert md[0].startswith("| server | c=1 tok/s") and md[1] == "|---|---|---|---|---|"


def test_one_point_and_missing_values():
    comp = compare_report.comparison({
        "a": [summary("a", 4, 10.0, None, 500.0, None)],
        "b": [summary("b", 4, 0.0, 5.0, 250.0, 8.0)]})
    rows = compare_report.table_rows(comp)
    assert rows[0] == ["server", "c=4 tok/s (p50 TPOT ms; p50 TTFT s)", "c=4 max ITL ms"]
    assert rows[1] == ["a", "10.0 (n/a; 0.50)", "n/a"]
    assert rows[3] == ["a / b", "n/a (n/a; 2.00x)", "n/a"]  # nothing divides by 0 tok/s


def test_rounds_give_medians_and_the_median_of_each_rounds_ratio():
    def one_round(a_tok, b_tok, a_ttft):
        return {"a": [summary("a", 32, a_tok, 10.0, a_ttft, 400.0)],
                "b": [summary("b", 32, b_tok, 20.0, 9000.0, 4000.0, failed=1)]}
    # The host's phase moves both servers of a round together: a slow round is slow for both.
    rounds = [one_round(300.0, 100.0, 5000.0), one_round(200.0, 80.0, 7000.0),
              one_round(250.0, 50.0, 6000.0)]
    comp = compare_report.rounds_comparison(rounds)
    assert comp["servers"]["a"]["32"]["output_tok_s"] == 250.0  # median of 300, 200, 250
    assert comp["servers"]["b"]["32"]["output_tok_s"] == 80.0
    assert comp["servers"]["a"]["32"]["median_ttft_s"] == 6.0
    # median of the rounds' ratios (3.0, 2.5, 5.0), not 250 / 80
    assert comp["ratios"]["32"]["output_tok_s"] == 3.0
    assert [r["ratios"]["32"]["output_tok_s"] for r in comp["per_round"]] == [3.0, 2.5, 5.0]
    merged = compare_report.median_summaries([r["b"] for r in rounds])
    assert merged[0]["failed"] == 3 and merged[0]["rounds"] == 3 and merged[0]["label"] == "b"
    rows = compare_report.rounds_rows(comp, [1, 1001, 2001], [["a", "b"], ["b", "a"], ["a", "b"]])
    assert rows[0] == ["round", "seed", "first", "c=32 tok/s (a / b)"]
    assert rows[2] == ["2", "1001", "b", "200.0 / 80.0 = 2.50x"]


def test_cpuinfo_flags():
    text = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
            "flags\t\t: fpu sse avx2 fma avx512f avx512_vnni amx_tile amx_int8\n\n"
            "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n")
    info = compare_report.parse_cpuinfo(text)
    assert info["cpu_model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert info["flags"] == {"avx2": True, "fma": True, "avx512f": True, "avx512_vnni": True,
                             "avx512_bf16": False, "amx_tile": True, "amx_int8": True,
                             "amx_bf16": False}
    assert compare_report._flags(info["flags"]) == "avx2 fma avx512f avx512_vnni amx_tile amx_int8"
    assert compare_report._flags({"avx2": True}) == "avx2 (no AMX)"


def test_llama_server_command_line():
    assert launch.llama_ctx_size(32, 512 + 128) == 32 * 768  # 640 + 64 rounded up to 256
    assert launch.llama_ctx_size(1, 192) == 256
    cmd = launch.llama_server_command("/b/llama-server", "/m.gguf", 8123, 2, 32, 24576, ["--foo"])
    assert cmd == ["/b/llama-server", "-m", "/m.gguf", "--host", "127.0.0.1", "--port", "8123",
                   "-t", "2", "-np", "32", "--cont-batching", "-c", "24576", "--foo"]
    assert launch.radixray_command(8124, ["--quantization", "w8a8_int8"])[-7:] == [
        "serve", "--host", "127.0.0.1", "--port", "8124", "--quantization", "w8a8_int8"]


def test_prompt_token_agreement():
    assert compare.prompt_tokens_agree([[512, 510], [512, 512]])
    assert not compare.prompt_tokens_agree([[512, 400], [512, 512]])
    assert not compare.prompt_tokens_agree([[512, 512], [None, 512]])


def parse(*argv):
    parser = argparse.ArgumentParser()
    compare.add_parser(parser.add_subparsers(dest="bench_command", required=True))
    return parser.parse_args(["compare", *argv])


@pytest.mark.parametrize("argv, needles", [
    ((), ["--llama-server-url", "--llama-gguf", "--llama-server-bin", "docs/benchmarks.md"]),
    (("--llama-gguf", "/nowhere/model.gguf"), ["--llama-gguf: no file /nowhere/model.gguf"]),
    (("--llama-gguf", "GGUF"), ["llama-server is not on PATH", "--llama-server-bin"]),
    (("--llama-gguf", "GGUF", "--llama-server-bin", "GGUF"), ["is not an executable file"]),
    (("--llama-server-url", "http://127.0.0.1:9", "--llama-gguf", "GGUF"),
     ["leave out --llama-gguf"]),
    (("--llama-server-url", "http://127.0.0.1:9", "--radixray-url", "http://127.0.0.1:9",
      "--radixray-args", "--quantization w8a8_int8"), ["--radixray-args applies only"]),
    (("--llama-server-url", "http://127.0.0.1:9", "--radixray-args", "--port 8000"),
     ["--radixray-args: leave out --port"]),
    (("--llama-server-url", "http://127.0.0.1:9", "--sweep", "1,4"), ["--sweep-num-prompts"]),
    (("--llama-server-url", "http://127.0.0.1:9", "--sweep", "1,4", "--sweep-num-prompts", "2"),
     ["one count per --sweep value"]),
    (("--llama-server-url", "http://127.0.0.1:9", "--rounds", "0"),
     ["--rounds: 0 is below 1"]),
])
def test_flag_errors_name_the_flags_and_start_nothing(argv, needles, tmp_path, monkeypatch,
                                                      capsys):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no llama-server on PATH
    out_dir = tmp_path / "out"
    args = parse(*[str(gguf) if a == "GGUF" else a for a in argv], "--output-dir", str(out_dir))
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    for needle in needles:
        assert needle in err
    assert not out_dir.exists()  # refused before anything ran


def test_unreachable_server_fails_cleanly(tmp_path, capsys, tiny_llama_dir):
    port = launch.free_port()
    args = parse("--radixray-url", f"http://127.0.0.1:{port}", "--llama-server-url",
                 f"http://127.0.0.1:{port}", "--tokenizer", tiny_llama_dir,
                 "--output-dir", str(tmp_path))
    assert args.func(args) == 1
    assert f"127.0.0.1:{port}" in capsys.readouterr().err


@pytest.fixture(scope="module")
def naive_url(tiny_llama_dir):
    """The naive server on the tiny Llama, served in a thread on a free port."""
    from radixray.bench.naive_server import NaiveServer, create_app
    with uvicorn_in_thread(create_app(NaiveServer.load(tiny_llama_dir, model_id="tiny"))) as url:
        yield url


SHORT_SWEEP = ("--sweep", "1,2", "--sweep-num-prompts", "2,3", "--random-input-len", "12",
               "--random-output-len", "4", "--disable-tqdm")


def check_outputs(out_dir, capsys, labels=("radixray", "llama-server")) -> dict:
    report = json.loads((out_dir / "compare.json").read_text())
    md = (out_dir / "compare.md").read_text()
    assert md in capsys.readouterr().out  # printed as written
    assert "| c=1 tok/s (p50 TPOT ms) | c=2 tok/s (p50 TTFT s) | c=2 max ITL ms |" in md
    assert f"| {labels[0]} / {labels[1]} |" in md and "- host: " in md and "- commit: " in md
    assert (out_dir / "compare.png").read_bytes()[:4] == b"\x89PNG"
    for label in labels:
        runs = report["servers"][label]["summaries"]
        assert [(s["max_concurrency"], s["completed"], s["failed"]) for s in runs] == \
            [(1, 2, 0), (2, 3, 0)]
        assert all(s["total_output_tokens"] == 4 * s["completed"] for s in runs)
        assert all(isinstance(n, int) and n > 0
                   for n in report["servers"][label]["probe_prompt_tokens"])
    assert set(report["comparison"]["ratios"]) == {"1", "2"}
    assert report["host"]["cpu_count"] == os.cpu_count()
    return report


def test_compare_two_running_servers(naive_url, tiny_llama_dir, tmp_path, capsys):
    out_dir = tmp_path / "out"
    args = parse("--radixray-url", naive_url, "--llama-server-url", naive_url,
                 "--tokenizer", tiny_llama_dir, "--output-dir", str(out_dir), *SHORT_SWEEP)
    args.argv = ["bench", "compare", "--radixray-url", naive_url]
    assert args.func(args) == 0
    report = check_outputs(out_dir, capsys)
    assert report["command"] == f"radixray bench compare --radixray-url {naive_url}"
    assert report["prompt_check"]["agree"]  # one server, counted twice
    assert report["servers"]["radixray"]["command"] is None  # nothing was started
    assert "random 12 in / 4 out" in report["workload"]


def test_two_rounds_swap_the_order_and_draw_new_prompts(naive_url, tiny_llama_dir, tmp_path,
                                                       capsys):
    out_dir = tmp_path / "out"
    args = parse("--radixray-url", naive_url, "--llama-server-url", naive_url, "--rounds", "2",
                 "--seed", "7", "--tokenizer", tiny_llama_dir, "--output-dir", str(out_dir),
                 *SHORT_SWEEP)
    assert args.func(args) == 0
    out = capsys.readouterr().out
    report = json.loads((out_dir / "compare.json").read_text())
    assert report["rounds"] == [{"seed": 7, "order": ["radixray", "llama-server"]},
                                {"seed": 1007, "order": ["llama-server", "radixray"]}]
    assert "round 1 of 2 (seed 7, radixray first): c=2 radixray" in out
    assert "round 2 of 2 (seed 1007, llama-server first)" in out
    for label in ("radixray", "llama-server"):  # both rounds' requests, every one served
        runs = report["servers"][label]["summaries"]
        assert [(s["max_concurrency"], s["completed"], s["failed"]) for s in runs] == \
            [(1, 2, 0), (2, 3, 0)] * 2
    per_round = report["comparison"]["per_round"]
    assert len(per_round) == 2 and set(report["comparison"]["ratios"]) == {"1", "2"}
    md = (out_dir / "compare.md").read_text()
    assert "Medians of 2 rounds" in md and "| round | seed | first |" in md
    assert "| 2 | 1007 | llama-server |" in md
    assert (out_dir / "compare.png").read_bytes()[:4] == b"\x89PNG"


FAKE_LLAMA_SERVER = """#!{python}
# Stands in for llama-server: records its flags, then serves the naive server on the port
# it was given, with the model folder of the file given to -m.
import json, os, sys
args = sys.argv[1:]
with open({record!r}, "w") as f:
    json.dump(args, f)
model = os.path.dirname(args[args.index("-m") + 1])
os.execv(sys.executable, [sys.executable, "-m", "radixray.cli", "bench", "naive-server",
                          "--model", model, "--host", args[args.index("--host") + 1],
                          "--port", args[args.index("--port") + 1], "--log-level", "warning"])
"""


@pytest.mark.slow
def test_compare_starts_and_stops_both_servers(tiny_llama_dir, tmp_path, capsys):
    record = tmp_path / "llama_args.json"
    fake = tmp_path / "llama-server"
    fake.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable, record=str(record)))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    out_dir = tmp_path / "out"
    serve_flags = (f"--model {tiny_llama_dir} --dtype float32 --max-total-tokens 4096 "
                   "--num-cpus 2 --served-model-name tiny")
    args = parse("--radixray-args", serve_flags, "--llama-server-bin", str(fake),
                 "--llama-gguf", os.path.join(tiny_llama_dir, "config.json"),
                 "--llama-threads", "2", "--tokenizer", tiny_llama_dir,
                 "--output-dir", str(out_dir), "--startup-timeout", "600", *SHORT_SWEEP)
    assert args.func(args) == 0
    report = check_outputs(out_dir, capsys)
    rr, ll = report["servers"]["radixray"], report["servers"]["llama-server"]
    assert rr["model"] == "tiny" and rr["command"][-10:] == serve_flags.split()
    assert json.loads(record.read_text())[2:] == [
        "--host", "127.0.0.1", "--port", ll["url"].rsplit(":", 1)[1], "-t", "2", "-np", "2",
        "--cont-batching", "-c", str(launch.llama_ctx_size(2, 12 + 4))]
    # Both were stopped: nothing answers on their ports any more.
    for server in (rr, ll):
        with pytest.raises(httpx.ConnectError):
            httpx.get(server["url"] + "/health", timeout=5)
        assert os.path.getsize(server["log"]) > 0
