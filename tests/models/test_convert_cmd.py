"""`legorl convert` between HF directories and Orbax params checkpoints."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from legorl_jax.cli import main
from legorl_jax.commands.convert_cmd import parse_size
from legorl_jax.models import from_hf


def _params(path: Path, dtype: str = "float32") -> dict:
    model = from_hf(path, dtype=dtype)
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_hf_to_orbax_to_hf_is_exact(tiny_hf_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    src = Path(shutil.copytree(tiny_hf_checkpoint("qwen3_moe"), tmp_path / "src"))
    (src / "tokenizer_config.json").write_text('{"model_max_length": 256}')
    assert main(["convert", "--from-hf", str(src), "--to-orbax", str(tmp_path / "ckpt")]) == 0
    out = tmp_path / "back"
    argv = ["convert", "--from-orbax", str(tmp_path / "ckpt"), "--config-from", str(src), "--to-hf", str(out)]
    assert main(argv) == 0
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 256}'
    original, back = _params(src), _params(out)
    for key, value in original.items():
        np.testing.assert_array_equal(value, back[key])


def test_hf_to_hf_casts_and_shards(tiny_hf_checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    src, out = tiny_hf_checkpoint("llama3"), tmp_path / "bf16"
    assert main(["convert", "--from-hf", str(src), "--to-hf", str(out), "--dtype", "bfloat16",
                 "--max-shard-size", "50KB"]) == 0  # fmt: skip
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    exported = _params(out, "bfloat16")
    for key, value in _params(src, "bfloat16").items():
        np.testing.assert_array_equal(value, exported[key])


def test_errors_are_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", "--from-orbax", str(tmp_path), "--to-hf", str(tmp_path / "o")]) == 2
    assert "--config-from" in capsys.readouterr().err
    assert main(["convert", "--from-hf", str(tmp_path / "none"), "--to-hf", str(tmp_path / "o")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2 MiB") == 2 * 2**20
    assert parse_size("123") == 123
    for bad in ("lots", "5XB", "0"):
        with pytest.raises(Exception, match="size"):
            parse_size(bad)
