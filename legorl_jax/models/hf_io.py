"""Import from and export to HF checkpoint directories (config.json + safetensors).

Import builds the model abstractly (no random init) and fills each parameter
with `jax.make_array_from_callback`, so every device shard is read straight
from the safetensors slices it covers: a process never holds a full host copy
of a large model. Export writes tensors shard file by shard file, holding at
most one stacked parameter plus one shard file in host memory.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from legorl_jax.core.errors import InputError
from legorl_jax.core.safetensors_io import SafetensorsFile, read_blocks, save_file
from legorl_jax.models.config import AttentionKernel, DType, ModelConfig, Remat, from_hf_config, to_hf_config
from legorl_jax.models.hf_names import IGNORED_HF_SUFFIXES, TensorMap, tensor_map
from legorl_jax.models.lora import adapted, merged_weight
from legorl_jax.models.sharding import param_sharding
from legorl_jax.models.transformer import CausalLM

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
_XLA_ALIGN = 64
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class CheckpointError(ValueError, InputError):
    """An HF checkpoint directory is missing files or tensors, or has unexpected ones."""


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json")
    return json.loads(config_file.read_text())


def _weight_files(path: Path) -> dict[str, SafetensorsFile]:
    """HF tensor name -> the (memory-mapped) file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        missing = sorted(f for f in set(weight_map.values()) if not (path / f).is_file())
        if missing:
            raise CheckpointError(f"{path}: shard files listed in the index are missing: {missing[:3]}")
        files = {f: SafetensorsFile(path / f) for f in set(weight_map.values())}
        return {name: files[f] for name, f in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{path}: neither model.safetensors nor model.safetensors.index.json")
    mapped = SafetensorsFile(single)
    return dict.fromkeys(mapped.keys(), mapped)


def abstract_model(config: ModelConfig) -> CausalLM:
    """The model with ShapeDtypeStruct leaves: shapes without allocating or initialising."""
    graphdef, flat = _abstract_parts(config)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _abstract_parts(config: ModelConfig) -> tuple[nnx.GraphDef[CausalLM], list[tuple[Any, nnx.Variable[Any]]]]:
    """The abstract model's graph and fresh (path, Variable) pairs, free for the caller to fill."""
    graphdef, flat = _traced_model(config)
    return graphdef, [(p, var.replace(var.get_value())) for p, var in flat]


@functools.lru_cache(maxsize=8)
def _traced_model(config: ModelConfig) -> tuple[nnx.GraphDef[CausalLM], tuple[tuple[Any, nnx.Variable[Any]], ...]]:
    # Tracing the constructor costs tens of milliseconds of Python per call;
    # the engine re-imports the same architecture on every weight update.
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0))))
    return graphdef, tuple(nnx.to_flat_state(state))


def from_hf(
    path: str | os.PathLike[str],
    *,
    dtype: DType = "float32",
    compute_dtype: DType | None = None,
    remat: Remat = "none",
    attention_kernel: AttentionKernel = "auto",
    mesh: Mesh | None = None,
) -> CausalLM:
    """Load an HF checkpoint as a `CausalLM`.

    dtype is the parameter dtype; compute_dtype (default: dtype) that of
    activations. With a mesh, parameters are placed per the partition rules.
    """
    path = Path(path)
    config = from_hf_config(
        read_hf_config(path),
        param_dtype=dtype,
        compute_dtype=compute_dtype or dtype,
        remat=remat,
        attention_kernel=attention_kernel,
    )
    files = _weight_files(path)
    graphdef, flat = _abstract_parts(config)
    used: set[str] = set()
    for p, var in flat:
        tmap = tensor_map(p)
        shape, want = var.get_value().shape, var.get_value().dtype
        names = dict(tmap.hf_names(shape))
        for name in names.values():
            if name not in files:
                raise CheckpointError(f"{path}: tensor {name} missing (needed for {'/'.join(p)})")
            if files[name].shape(name) != tmap.hf_shape(shape):
                raise CheckpointError(
                    f"{path}: {name} has shape {files[name].shape(name)}, config implies {tmap.hf_shape(shape)}"
                )
        used.update(names.values())
        var.set_value(_load_param(tmap, names, files, shape, want, param_sharding(p, shape, mesh)))
    unused = sorted(
        n
        for n in files
        if n not in used
        and not n.endswith(IGNORED_HF_SUFFIXES)
        # Some tied checkpoints still carry a copy of the embedding as lm_head.
        and not (n == "lm_head.weight" and config.tie_word_embeddings)
    )
    if unused:
        raise CheckpointError(f"{path}: tensors not used by the {config.architecture} model: {unused[:5]}")
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _load_param(
    tmap: TensorMap,
    names: dict[tuple[int, ...], str],
    files: dict[str, SafetensorsFile],
    shape: tuple[int, ...],
    dtype: Any,
    sharding: jax.sharding.Sharding,
) -> jax.Array:
    """One parameter, each device reading only its block of the HF tensors."""
    counts = shape[: tmap.stack_dims]

    def read(index: tuple[slice, ...]) -> np.ndarray:
        stack_ranges = [range(*s.indices(n)) for s, n in zip(index, counts, strict=False)]
        rest = index[tmap.stack_dims :]
        block = tuple(len(range(*s.indices(n))) for s, n in zip(rest, tmap.hf_shape(shape), strict=True))
        out = _aligned_empty((*map(len, stack_ranges), *block), dtype)
        flat = out.reshape(-1, *block)
        keys = itertools.product(*stack_ranges)
        read_blocks((files[names[key]], names[key], rest, flat[i]) for i, key in enumerate(keys))
        return out

    # jax annotates the callback's index as optional, yet asserts it is not None before each call.
    return jax.make_array_from_callback(shape, sharding, read)  # type: ignore[arg-type]


def _aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A fresh host array that jax's CPU backend adopts without a copy.

    XLA on CPU aliases a numpy buffer only when it is 64-byte aligned (numpy
    gives 16); a copy of each parameter cost as much as reading it. Never a
    file view instead: the file could later be overwritten by an export to
    the same path while the model still uses the memory.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + _XLA_ALIGN, np.uint8)
    skip = -raw.ctypes.data % _XLA_ALIGN
    return raw[skip : skip + nbytes].view(dtype).reshape(shape)


def _host_array(value: jax.Array, dtype: Any) -> np.ndarray:
    value = value.astype(dtype)
    if not value.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(jax.device_get(value))


def _hf_tensors(model: CausalLM, dtype: Any | None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, host array) for every tensor, one stacked parameter fetched at a time."""
    # Adapters are written folded into their weights: what an engine serves.
    merged = {(*stem, "weight"): module for stem, module in adapted(model)}
    for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        path = tuple(map(str, p))  # keys are attribute names: the model holds no lists
        if isinstance(var, nnx.LoRAParam):
            continue
        value = merged_weight(merged[path]) if path in merged else var.get_value()
        tmap = tensor_map(path)
        host = _host_array(value, dtype or value.dtype)
        for idx, name in tmap.hf_names(host.shape):
            yield name, np.ascontiguousarray(host[idx])


def to_hf(
    model: CausalLM,
    out_dir: str | os.PathLike[str],
    *,
    tokenizer_from: str | os.PathLike[str] | None = None,
    dtype: DType | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write `model` as an HF checkpoint directory loadable by transformers and vLLM.

    dtype defaults to the parameters' dtype. Files exceed max_shard_bytes only
    when a single tensor does. Tokenizer files (and generation_config.json) are
    copied from `tokenizer_from`. Every process must call this (multi-host
    gathers); only process 0 writes.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out = Path(out_dir)
    writer = jax.process_index() == 0
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    stored = dtype or model.config.param_dtype
    shards: list[Path] = []
    weight_map: dict[str, int] = {}
    pending: dict[str, np.ndarray] = {}
    pending_bytes = total = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        if pending and writer:
            shards.append(out / f".shard-{len(shards)}.tmp")
            save_file(pending, shards[-1])
        elif pending:
            shards.append(Path())
        pending, pending_bytes = {}, 0

    for name, array in _hf_tensors(model, jnp.dtype(stored)):
        if pending and pending_bytes + array.nbytes > max_shard_bytes:
            flush()
        pending[name], weight_map[name] = array, len(shards)
        pending_bytes += array.nbytes
        total += array.nbytes
    flush()
    if not writer:
        return out
    _finish_shards(out, shards, weight_map, total)
    (out / "config.json").write_text(json.dumps(to_hf_config(model.config, dtype=stored), indent=2) + "\n")
    _write_side_files(model.config, out, tokenizer_from)
    return out


def _finish_shards(out: Path, shards: list[Path], weight_map: dict[str, int], total: int) -> None:
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    if len(shards) == 1:
        shards[0].rename(out / "model.safetensors")
        return
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for tmp, name in zip(shards, names, strict=True):
        tmp.rename(out / name)
    index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in weight_map.items()}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_side_files(config: ModelConfig, out: Path, tokenizer_from: str | os.PathLike[str] | None) -> None:
    if tokenizer_from is not None:
        src = Path(tokenizer_from)
        if not src.is_dir():
            raise CheckpointError(f"tokenizer_from={src} is not a directory")
        for name in _TOKENIZER_FILES:
            if (src / name).is_file() and (src / name).resolve() != (out / name).resolve():
                shutil.copyfile(src / name, out / name)
    if not (out / "generation_config.json").is_file():
        ids = {k: v for k, v in config.passthrough if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        (out / "generation_config.json").write_text(json.dumps({"_from_model_config": True, **ids}, indent=2) + "\n")
