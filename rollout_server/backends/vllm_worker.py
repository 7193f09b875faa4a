"""vLLM worker extension: reload weights from an HF safetensors directory.

vLLM mixes this class into every GPU worker (`--worker-extension-cls`), and
`POST /collective_rpc {"method": "reload_weights_from_path", "kwargs":
{"weights_path": DIR}}` runs it on each of them. The method name differs from
the worker's own `reload_weights`, which vLLM forbids an extension to shadow.
It needs torch and safetensors only; vLLM supplies `self.model_runner`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any


def safetensors_weights(weights_path: str | Path) -> Iterator[tuple[str, Any]]:
    """(name, CPU tensor) for every tensor of every *.safetensors file in the directory."""
    from safetensors import safe_open

    files = sorted(Path(weights_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{weights_path}: no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, handle.get_tensor(name)


class PathReloadExtension:
    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def reload_weights_from_path(self, weights_path: str) -> dict[str, Any]:
        # The model's own load_weights maps HF names (fused qkv, tied heads) the
        # way it did at start-up, and copies onto the device in place.
        loaded = self.model_runner.model.load_weights(weights=safetensors_weights(weights_path))
        return {"weights_path": str(weights_path), "tensors_loaded": len(loaded or ())}
