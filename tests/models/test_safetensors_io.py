"""Our safetensors reader/writer agree with the safetensors library."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from legorl_jax.core import safetensors_io
from legorl_jax.core.safetensors_io import SafetensorsFile, SafetensorsFileError, read_blocks, save_file


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "a.bf16": rng.normal(size=(6, 5)).astype(ml_dtypes.bfloat16),
        "b.f32": rng.normal(size=(3, 4, 2)).astype(np.float32),
        "c.i64": np.arange(7, dtype=np.int64),
    }


def test_written_file_reads_back_in_the_library(tmp_path: Path) -> None:
    tensors = _tensors()
    save_file(tensors, tmp_path / "t.safetensors")
    with safe_open(tmp_path / "t.safetensors", "flax") as f:
        assert set(f.keys()) == set(tensors)
        assert f.metadata() == {"format": "pt"}
        assert [f.get_slice(n).get_dtype() for n in tensors] == ["BF16", "F32", "I64"]
        for name, value in tensors.items():
            # (jax without x64 hands int64 back as int32; the values are what matter)
            np.testing.assert_array_equal(np.asarray(f.get_tensor(name)).astype(value.dtype), value)


def test_read_into_blocks_and_casts(tmp_path: Path) -> None:
    tensors = _tensors()
    save_file(tensors, tmp_path / "t.safetensors")
    f = SafetensorsFile(tmp_path / "t.safetensors")
    assert f.shape("b.f32") == (3, 4, 2)
    for index in [(slice(None), slice(None)), (slice(2, 5), slice(None)), (slice(1, 4), slice(2, 5))]:
        ref = tensors["a.bf16"][index]
        out = np.empty(ref.shape, np.float32)  # bf16 on disk, f32 wanted
        f.read_into("a.bf16", index, out)
        np.testing.assert_array_equal(out, ref.astype(np.float32))
    out = np.empty((7,), np.int64)
    f.read_into("c.i64", (slice(None),), out)
    np.testing.assert_array_equal(out, tensors["c.i64"])


def test_bad_files_raise_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(SafetensorsFileError, match="truncated header"):
        SafetensorsFile(tmp_path / "short.safetensors")
    (tmp_path / "junk.safetensors").write_bytes((4).to_bytes(8, "little") + b"{no}")
    with pytest.raises(SafetensorsFileError, match="not JSON"):
        SafetensorsFile(tmp_path / "junk.safetensors")
    save_file({"x": np.zeros((4, 4), np.float32)}, tmp_path / "cut.safetensors")
    data = (tmp_path / "cut.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-8])
    with pytest.raises(SafetensorsFileError, match="inconsistent data offsets"):
        SafetensorsFile(tmp_path / "cut.safetensors").read_into("x", (), np.empty((4, 4), np.float32))
    with pytest.raises(ValueError, match="cannot be stored"):
        save_file({"c": np.zeros(2, np.complex64)}, tmp_path / "c.safetensors")
    assert jnp.dtype(ml_dtypes.bfloat16) == jnp.bfloat16


def test_chunked_parallel_reads_fill_every_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks far smaller than the tensors, so one block is read by several tasks at once.
    monkeypatch.setattr(safetensors_io, "_CHUNK", 64)
    rng = np.random.default_rng(1)
    tensors = {f"w{i}": rng.normal(size=(37, 11)).astype(np.float32) for i in range(5)}
    save_file(tensors, tmp_path / "t.safetensors")
    f = SafetensorsFile(tmp_path / "t.safetensors")
    outs = {name: np.empty((20, 11), np.float32) for name in tensors}
    read_blocks((f, name, (slice(9, 29),), out) for name, out in outs.items())
    for name, out in outs.items():
        np.testing.assert_array_equal(out, tensors[name][9:29])
    header_len = int.from_bytes((tmp_path / "t.safetensors").read_bytes()[:8], "little")
    assert (8 + header_len) % 4096 == 0  # tensor data starts on a page boundary


def test_truncated_data_is_named_in_a_chunked_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(safetensors_io, "_CHUNK", 64)
    save_file({"x": np.zeros((64, 4), np.float32)}, tmp_path / "t.safetensors")
    f = SafetensorsFile(tmp_path / "t.safetensors")
    # The file shrinks after it was opened (say, an export rewriting it): reads come up short.
    size = (tmp_path / "t.safetensors").stat().st_size
    with open(tmp_path / "t.safetensors", "r+b") as raw:
        raw.truncate(size - 512)
    with pytest.raises(SafetensorsFileError, match="x is truncated"):
        f.read_into("x", (), np.empty((64, 4), np.float32))
