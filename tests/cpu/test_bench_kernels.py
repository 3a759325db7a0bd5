"""`radixray bench kernels` runs end to end at tiny sizes and reports every kernel row."""

import json

import pytest

from radixray.cli import main
from radixray.kernels.cpu_ops import load_extension
from radixray.kernels.int8_linear import amx_available, vnni_available


@pytest.mark.skipif(load_extension() is None, reason="C++ CPU kernels not built here")
def test_bench_kernels_reports_each_kernel(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    rc = main(["bench", "kernels", "--batch", "3", "--context-len", "20", "--prefill-len", "40",
               "--calls", "1", "--repeats", "1", "--layers", "1", "--output-json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    ext = load_extension()
    vnni = ["int8 GEMM VNNI"] * 4 if vnni_available(ext) else []  # 1, 8, 3, 256 rows
    amx = ["int8 GEMM AMX"] * 4 if amx_available(ext) else []
    isa = (["decode AVX-512"] * 2 if ext.decode_avx512_supported() else []) + \
        (["int8 gate_up fused"] * 2 if ext.int8_amx_supported() else []) + \
        (["extend AMX-BF16"] * 2 if ext.amx_bf16_supported() else [])
    assert [r["kernel"] for r in rows] == ["decode attention"] * 3 + ["extend attention"] * 2 + \
        ["int8 MLP middle"] * 2 + ["add + rms_norm"] * 2 + ["int8 GEMM AVX2"] * 2 + vnni + amx + \
        ["lm_head int8"] + isa
    assert all(r["cpp_ms"] > 0 and r["torch_ms"] > 0 and r["speedup"] > 0 for r in rows)
    assert "speedup" in capsys.readouterr().out


def test_bench_kernels_vnni_rows_option(tmp_path):
    if not vnni_available(load_extension()):
        pytest.skip("needs AVX-512 VNNI")
    out = tmp_path / "kernels.json"
    assert main(["bench", "kernels", "--batch", "3", "--context-len", "20", "--prefill-len", "40",
                 "--calls", "1", "--repeats", "1", "--layers", "1", "--vnni-rows", "2,64,2",
                 "--output-json", str(out)]) == 0
    shapes = [r["shape"] for r in json.loads(out.read_text())["rows"] if r["kernel"] == "int8 GEMM VNNI"]
    assert shapes == ["2 rows x 4 weights", "64 rows x 4 weights"]
