"""Fixtures of the weight-publishing tests: one tiny HF checkpoint (with the
demo tokenizer) per session, its policy, a bitwise parameter comparison, and a
GCS emulator (`emulated_gcs.py`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from legorl_jax.models import CausalLM, from_hf
from legorl_jax.models.demo_assets import build_tiny_hf_model

from .emulated_gcs import Emulator, point_at


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hf_model(
        tmp_path_factory.mktemp("base") / "tiny", hidden_size=32, head_dim=8, intermediate_size=64, num_layers=2
    )


@pytest.fixture(scope="session")
def model(hf_dir: Path) -> CausalLM:
    return from_hf(hf_dir)


def param_bytes(model: CausalLM) -> dict[str, tuple[str, bytes]]:
    """Every parameter as (dtype, raw bytes): equality is bit-identity."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        array = np.asarray(var.get_value())
        out["/".join(map(str, path))] = (str(array.dtype), array.tobytes())
    return out


@pytest.fixture(scope="session")
def assert_loads_identical() -> Callable[..., None]:
    """(directory, model, dtype) -> loads `directory` with from_hf and checks
    every parameter is bit-identical to `model`'s."""

    def check(directory: str | Path, model: CausalLM, dtype: str = "float32") -> None:
        loaded, expected = param_bytes(from_hf(directory, dtype=dtype)), param_bytes(model)  # type: ignore[arg-type]
        assert loaded.keys() == expected.keys()
        differing = [k for k in expected if loaded[k] != expected[k]]
        assert not differing, f"parameters differ: {differing[:5]}"

    return check


@pytest.fixture
def emulator(monkeypatch: pytest.MonkeyPatch) -> Iterator[Emulator]:
    """A running emulator the environment points tensorstore's gcs driver and gcsfs at."""
    emu = Emulator()
    emu.start()
    point_at(emu, monkeypatch)
    try:
        yield emu
    finally:
        emu.stop()
