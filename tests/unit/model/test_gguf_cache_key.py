"""The GGUF conversion cache key: the same bytes reuse a conversion wherever the file lies and whatever
its mtime (image layers do not keep nanoseconds), and different bytes never do."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from lmi_serve.model.loader import _gguf_cache_folder

SIZE = 4096


def _write(path: Path, fill: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(fill * SIZE)
    return path


@pytest.fixture
def original(tmp_path: Path) -> Path:
    gguf = _write(tmp_path / "build" / "model.Q4_1.gguf", b"a")
    os.utime(gguf, ns=(1_700_000_000_123_456_789, 1_700_000_000_123_456_789))
    return gguf


def test_a_copy_with_another_path_and_mtime_reuses_the_conversion(tmp_path, original):
    layer_copy = tmp_path / "layer" / original.name
    layer_copy.parent.mkdir()
    shutil.copyfile(original, layer_copy)
    os.utime(layer_copy, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))  # seconds only, as in a tar layer

    assert _gguf_cache_folder(str(tmp_path / "cache"), layer_copy) == _gguf_cache_folder(str(tmp_path / "cache"), original)


def test_the_folder_is_under_cache_dir_and_named_after_the_file(tmp_path, original):
    folder = _gguf_cache_folder(str(tmp_path / "cache"), original)

    assert folder.parent == tmp_path / "cache" / "gguf"
    assert folder.name.startswith("model.Q4_1-")


def test_different_bytes_of_the_same_name_size_and_mtime_get_their_own_conversion(tmp_path, original):
    other = _write(tmp_path / "other" / original.name, b"b")
    stat = original.stat()
    os.utime(other, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert other.stat().st_size == stat.st_size

    assert _gguf_cache_folder(str(tmp_path / "cache"), other) != _gguf_cache_folder(str(tmp_path / "cache"), original)


def test_a_file_changed_in_place_gets_a_new_conversion(tmp_path, original):
    before = _gguf_cache_folder(str(tmp_path / "cache"), original)
    with open(original, "r+b") as file:
        file.seek(SIZE // 2)
        file.write(b"z")

    assert _gguf_cache_folder(str(tmp_path / "cache"), original) != before


def test_another_transformers_version_converts_again(tmp_path, original, monkeypatch):
    import transformers

    before = _gguf_cache_folder(str(tmp_path / "cache"), original)
    monkeypatch.setattr(transformers, "__version__", transformers.__version__ + ".post1")

    assert _gguf_cache_folder(str(tmp_path / "cache"), original) != before
