"""The published-weights layout, shared by the learner that writes it and the
rollout host that reads it.

A weights root holds one directory per policy version (`version_dir_name`).
Each is an HF directory (config, tokenizer, safetensors files and their index)
plus `weights.json` (`Manifest`: its version, the digest of its exact
tensors, `weight_delta.weights_digest`, and the learner's logprobs of the
probe sequence, `weight_probe`); a delta version holds only the
manifest, naming its base, and `delta.bin`. A LoRA run's adapter version
holds PEFT's `adapter_config.json` and `adapter_model.safetensors` beside its
manifest, which names the digest of the base checkpoint the adapter applies to
(`Manifest.adapter_base`, `checkpoint_digest`). Directories are built under a
hidden name starting with `TMP_PREFIX` and renamed into place when complete
(`install_directory`), so a reader never sees a half-written version.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from legorl_jax.core import safetensors_io
from legorl_jax.core.weight_delta import weights_digest
from legorl_jax.core.weight_probe import WeightProbe

INDEX_FILE = "model.safetensors.index.json"
MANIFEST_FILE = "weights.json"
DELTA_FILE = "delta.bin"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# Hidden names of directories being built or discarded; anything else under a root is a version.
TMP_PREFIX = ".incoming-"


class WeightTransferError(ValueError):
    """Weights could not be received or located: the message says what was wrong."""


@dataclasses.dataclass(frozen=True)
class Manifest:
    """`weights.json`: which version a directory holds; a delta's base, if it is one; for an
    adapter version, the digest of the base checkpoint it applies to (`digest` is then the adapter's)."""

    version: int
    digest: str
    base_version: int | None = None
    base_digest: str | None = None
    probe: WeightProbe | None = None  # the learner's logprobs of the probe under these weights
    adapter_base: str | None = None

    def to_bytes(self) -> bytes:
        fields = dataclasses.asdict(self)
        fields["probe"] = None if self.probe is None else self.probe.to_json()
        return json.dumps(fields).encode()

    @classmethod
    def parse(cls, raw: bytes, where: str) -> Manifest:
        try:
            fields = json.loads(raw)
            probe = fields.pop("probe", None)
            return cls(**fields, probe=None if probe is None else WeightProbe.from_json(probe))
        except (ValueError, TypeError, KeyError) as exc:
            raise WeightTransferError(f"{where}: {MANIFEST_FILE} is malformed: {exc!r}") from None


def read_manifest(directory: Path | None) -> Manifest | None:
    """The directory's manifest; None for a plain HF directory (or none at all)."""
    if directory is None or not (directory / MANIFEST_FILE).is_file():
        return None
    return Manifest.parse((directory / MANIFEST_FILE).read_bytes(), str(directory))


def checkpoint_digest(directory: Path) -> str:
    """The digest of a full checkpoint's tensors: its manifest's, or (a plain HF directory, such as
    the model a run starts from) computed from its files. What an adapter version's base must match."""
    manifest = read_manifest(directory)
    if manifest is not None and manifest.adapter_base is None and manifest.base_version is None:
        return manifest.digest
    return weights_digest(read_tensors(directory))


def version_dir_name(version: int) -> str:
    return f"v{version:08d}"


def install_directory(tmp: Path, final: Path) -> None:
    """Renames a finished `tmp` to `final`, replacing an older `final` so that
    at no moment is `final` missing or partial (a republished version)."""
    if final.exists():
        trash = final.with_name(f"{TMP_PREFIX}trash-{final.name}-{uuid.uuid4().hex[:8]}")
        final.rename(trash)
        tmp.rename(final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        tmp.rename(final)


def parse_index(raw: bytes) -> tuple[dict[str, str], int | None]:
    """The index's weight map (tensor -> file name) and its total size, if it states one."""
    where = f"{INDEX_FILE} in the header"
    try:
        index: Any = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise WeightTransferError(f"{where} is not a safetensors index: not JSON: {exc}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise WeightTransferError(f"{where} is not a safetensors index: no weight_map of tensor names to file names")
    metadata = index.get("metadata") or {}
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    if total is not None and (not isinstance(total, int) or isinstance(total, bool) or total < 0):
        raise WeightTransferError(f"{where}: metadata.total_size {total!r} is not a byte count")
    return weight_map, total


def weight_files(directory: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name of an HF directory (or of an adapter version's adapter)."""
    index = directory / INDEX_FILE
    if index.is_file():
        return parse_index(index.read_bytes())[0]
    single = "model.safetensors"
    if not (directory / single).is_file() and (directory / ADAPTER_WEIGHTS_FILE).is_file():
        single = ADAPTER_WEIGHTS_FILE
    return dict.fromkeys(safetensors_io.SafetensorsFile(directory / single).keys(), single)


def read_tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of an HF directory in fresh host arrays (parallel reads)."""
    blocks = []
    for file in set(weight_files(directory).values()):
        reader = safetensors_io.SafetensorsFile(directory / file)
        blocks += [(reader, n, (), np.empty(reader.shape(n), reader.dtype(n))) for n in reader.keys()]
    safetensors_io.read_blocks(blocks)
    return {name: out for _, name, _, out in blocks}
