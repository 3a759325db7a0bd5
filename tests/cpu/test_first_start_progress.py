"""First start is not a silent minute: the GGUF conversion logs each stage with its elapsed
time, and the kernel compile says every 10 s how many sources are done."""

import logging
import threading

import pytest

from radixray.common.progress import Stages, Ticker, counted

LOG = logging.getLogger("radixray.test.progress")


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG.name]


def test_stages_number_each_step_and_say_how_long_it_has_run(caplog):
    caplog.set_level(logging.INFO, logger=LOG.name)
    stages = Stages(LOG, "GGUF conversion", 3)
    stages.done("config read")
    stages.done("tensors dequantized")
    lines = _lines(caplog)
    assert lines[0].startswith("GGUF conversion [1/3] config read (")
    assert lines[1].startswith("GGUF conversion [2/3] tensors dequantized (")
    assert all(line.endswith(" s)") for line in lines)


def test_counted_logs_each_quarter_when_not_on_a_terminal(caplog):
    caplog.set_level(logging.INFO, logger=LOG.name)
    assert list(counted(range(10), 10, "dequantizing", LOG, unit="tensors")) == list(range(10))
    lines = _lines(caplog)  # pytest's captured stderr is no terminal: log lines, no bar
    assert [line.split(" (")[0] for line in lines] == [
        "dequantizing: 2/10 tensors", "dequantizing: 5/10 tensors",
        "dequantizing: 7/10 tensors", "dequantizing: 10/10 tensors"]


def test_ticker_logs_until_its_block_ends(caplog):
    caplog.set_level(logging.INFO, logger=LOG.name)
    ticked = threading.Event()

    def message(elapsed: float) -> str:
        ticked.set()
        return f"still working ({elapsed:.1f} s)"
    with Ticker(message, LOG, interval_s=0.01):
        assert ticked.wait(30)
    count = len(_lines(caplog))
    assert count >= 1 and _lines(caplog)[0].startswith("still working (")
    assert len(_lines(caplog)) == count  # nothing after the block


def test_compile_ticker_counts_object_files(tmp_path):
    from radixray.kernels.cpu_ops import _compile_ticker
    for name in ("cpu_ops.o", "attention.o", "build.ninja"):
        (tmp_path / name).write_text("")
    ticker = _compile_ticker(str(tmp_path), 7)
    assert ticker.message(21.4) == "compiling radixray CPU kernels: 2/7 sources done (21 s)"


@pytest.mark.slow  # ~40 s: converts the default model's GGUF again into an empty cache
def test_gguf_conversion_logs_each_stage(tmp_path, monkeypatch, caplog):
    from radixray.engine.weights import loader
    monkeypatch.setenv("RADIXRAY_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, logger=loader.logger.name)
    out = loader.convert_gguf(loader.default_model_path())
    lines = [r.getMessage() for r in caplog.records if r.name == loader.logger.name]
    stages = [line for line in lines if line.startswith("GGUF conversion [")]
    assert [s.split("] ")[0] for s in stages] == [f"GGUF conversion [{i}/4" for i in (1, 2, 3, 4)]
    assert "272 tensors dequantized" in stages[2] and "MiB of safetensors" in stages[3]
    assert sum(line.startswith("dequantizing GGUF tensors: ") for line in lines) == 4
    assert out.startswith(str(tmp_path))
