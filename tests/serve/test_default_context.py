"""The engine's default context is the checkpoint's own, as vLLM's is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from legorl_jax.serve.loader import WeightsError, load_served_model, trained_context


def test_the_default_context_is_max_position_embeddings(tmp_path: Path) -> None:
    from legorl_jax.models.demo_assets import build_tiny_hf_model

    model_dir = build_tiny_hf_model(tmp_path / "model", max_position_embeddings=1536)
    assert trained_context(model_dir) == 1536
    served = load_served_model(model_dir, max_slots=2)
    try:
        assert served.engine.max_len == 1536
    finally:
        served.engine.shutdown()
    explicit = load_served_model(model_dir, max_slots=2, max_len=64)
    try:
        assert explicit.engine.max_len == 64
    finally:
        explicit.engine.shutdown()


@pytest.mark.parametrize("value", [None, 0, "4096"])
def test_a_config_without_a_usable_context_asks_for_one(tiny_model_dir: Path, tmp_path: Path, value: object) -> None:
    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("max_position_embeddings")
    if value is not None:
        config["max_position_embeddings"] = value
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match="no max_position_embeddings; give the context .--max-model-len."):
        load_served_model(model_dir, max_slots=2)
