"""The vLLM worker extension's loading path, with a stand-in model runner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rollout_server.backends.vllm_worker import PathReloadExtension


class RecordingModel:
    """TEST INSTRUMENT: stands in for a vLLM model; its load_weights records what it got."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: object) -> set[str]:
        for name, tensor in weights:  # type: ignore[attr-defined]
            self.params[name] = tensor
        return set(self.params)


class FakeWorker(PathReloadExtension):
    """TEST INSTRUMENT: the extension mixed into a stand-in worker."""

    def __init__(self) -> None:
        self.model_runner = type("Runner", (), {"model": RecordingModel()})()


def test_reload_reads_every_shard(tmp_path: Path) -> None:
    save_file({"a.weight": torch.ones(2, 3)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b.weight": torch.zeros(4)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    worker = FakeWorker()
    result = worker.reload_weights_from_path(str(tmp_path))
    assert result == {"weights_path": str(tmp_path), "tensors_loaded": 2}
    params = worker.model_runner.model.params
    assert torch.equal(params["a.weight"], torch.ones(2, 3)) and params["b.weight"].shape == (4,)


def test_directory_without_safetensors_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        FakeWorker().reload_weights_from_path(str(tmp_path))
