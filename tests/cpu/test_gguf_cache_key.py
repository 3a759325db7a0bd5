"""The converted-GGUF cache is keyed by the file's content, so copies in several checkouts share it."""

from __future__ import annotations

import os

from radixray.engine.weights.loader import _file_key


def _write(path, data: bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def test_copies_share_a_key_and_edits_at_either_end_or_in_size_do_not(tmp_path):
    data = bytearray(os.urandom(3 << 20))
    a = _write(tmp_path / "venv-a" / "m.gguf", bytes(data))
    b = _write(tmp_path / "venv-b" / "m.gguf", bytes(data))
    assert _file_key(a) == _file_key(b)
    head, tail = bytearray(data), bytearray(data)
    head[10] ^= 1
    tail[-10] ^= 1
    keys = {_file_key(_write(tmp_path / name / "m.gguf", bytes(d)))
            for name, d in (("head", head), ("tail", tail), ("longer", data + b"x"))}
    assert len(keys) == 3 and _file_key(a) not in keys
