"""Low-rank adapters (LoRA) on the model's projections, and their PEFT format.

An adapted projection computes W x + (alpha / r) * B (A x), with A [r, in] and
B [out, r] stacked over layers like W ([L, r, in], [L, out, r]). B starts at
zero, so adding adapters leaves the model's outputs unchanged. Adapters are
`nnx.LoRAParam`s: the learner trains those and keeps every other parameter
frozen. Exports stay plain: `to_hf` of an adapted model writes the merged
weights (W + scale * B @ A), and `save_peft` writes the adapters alone as a PEFT
directory, named as PEFT names them on the `transformers` model.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import get_args

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from legorl_jax.core.config import LoraTarget
from legorl_jax.core.errors import InputError
from legorl_jax.core.safetensors_io import SafetensorsFile, save_file
from legorl_jax.core.weight_layout import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from legorl_jax.models.hf_names import tensor_map
from legorl_jax.models.linear import Linear
from legorl_jax.models.sharding import param_sharding
from legorl_jax.models.transformer import CausalLM

TARGETS: tuple[str, ...] = get_args(LoraTarget)  # every projection an adapter may go on
PEFT_PREFIX = "base_model.model."  # where PEFT's LoraModel puts the wrapped model's own names


class LoraError(ValueError, InputError):
    """Adapters asked for that this model cannot take."""


def add_adapters(
    model: CausalLM, *, rank: int, alpha: float, targets: list[str], seed: int, mesh: Mesh | None = None
) -> list[str]:
    """Adds adapters to every layer's projections named in `targets` (e.g. "q_proj",
    "down_proj"); returns the adapted projections' paths. A is drawn as PEFT draws it
    (uniform in ±1/sqrt(in)), B is zero. A target this model lacks is an error (an
    MoE model's experts are not `Linear`s: its MLP names match nothing)."""
    found = []
    key = jax.random.key(seed)
    for path, module in nnx.iter_graph(model.layers):
        if not (isinstance(module, Linear) and path and path[-1] in targets):
            continue
        if module.lora_a is not None:
            raise LoraError(f"layers/{'/'.join(map(str, path))} already has adapters")
        layers, d_out, d_in = module.weight.get_value().shape
        stem = ("layers", *map(str, path))
        key, sub = jax.random.split(key)
        bound = 1.0 / math.sqrt(d_in)
        a_shape, b_shape = (layers, rank, d_in), (layers, d_out, rank)
        a = jax.random.uniform(sub, a_shape, jnp.float32, -bound, bound)
        module.lora_a = nnx.LoRAParam(jax.device_put(a, param_sharding((*stem, "lora_a"), a_shape, mesh)))
        b = jnp.zeros(b_shape, jnp.float32, device=param_sharding((*stem, "lora_b"), b_shape, mesh))
        module.lora_b = nnx.LoRAParam(b)
        module.lora_scale = alpha / rank
        found.append("/".join(stem))
    missing = sorted(set(targets) - {p.rsplit("/", 1)[-1] for p in found})
    if missing:
        kind = "MoE (its experts take no adapters)" if model.config.is_moe else "dense"
        raise LoraError(f"lora.targets {missing} name no projection of this {kind} {model.config.architecture} model")
    return found


def adapted(model: CausalLM) -> list[tuple[tuple[str, ...], Linear]]:
    """(path, projection) of every projection with adapters."""
    return [
        (("layers", *map(str, path)), module)
        for path, module in nnx.iter_graph(model.layers)
        if isinstance(module, Linear) and module.lora_a is not None
    ]


def describe(model: CausalLM) -> dict | None:
    """The adapters' settings, {"rank", "alpha", "targets"}, or None without adapters: what a
    checkpoint records so the adapters can be rebuilt to restore into."""
    found = adapted(model)
    if not found:
        return None
    module = found[0][1]
    assert module.lora_a is not None
    rank = int(module.lora_a.get_value().shape[1])
    return {"rank": rank, "alpha": module.lora_scale * rank, "targets": sorted({stem[-1] for stem, _ in found})}


def merged_weight(module: Linear) -> jax.Array:
    """W + scale * B @ A, per layer, in W's dtype: the weight an engine serves."""
    assert module.lora_a is not None and module.lora_b is not None
    w = module.weight.get_value()
    delta = jnp.einsum("lor,lri->loi", module.lora_b.get_value(), module.lora_a.get_value())
    return (w.astype(jnp.float32) + module.lora_scale * delta).astype(w.dtype)


def merge_adapters(model: CausalLM) -> CausalLM:
    """Folds every adapter into its weight (W + scale * B @ A) and removes it: what the
    embedded engine serves, no adapter products left in the forward. The weights' variables
    are set in place: merge a copy (`nnx.merge(..., copy=True)`) to keep the base."""
    for _, module in adapted(model):
        module.weight.set_value(merged_weight(module))
        module.lora_a, module.lora_b, module.lora_scale = None, None, 0.0
    return model


def peft_tensors(model: CausalLM) -> dict[str, np.ndarray]:
    """The adapters as PEFT names them (`base_model.model.<weight's name minus .weight>.lora_A.weight`,
    A [r, in] and B [out, r] per layer), float32. Multi-process: a collective (adapters sharded
    across processes are gathered), so every process calls it."""
    out: dict[str, np.ndarray] = {}
    for stem, module in adapted(model):
        template = tensor_map((*stem, "weight")).template.removesuffix(".weight")
        assert module.lora_a is not None and module.lora_b is not None
        for part, var in (("lora_A", module.lora_a), ("lora_B", module.lora_b)):
            value = var.get_value()
            whole = value if value.is_fully_addressable else multihost_utils.process_allgather(value, tiled=True)
            host = np.asarray(jax.device_get(whole), np.float32)
            for layer in range(host.shape[0]):
                out[f"{PEFT_PREFIX}{template.format(layer=layer)}.{part}.weight"] = np.ascontiguousarray(host[layer])
    return out


def save_peft(model: CausalLM, out_dir: str | os.PathLike[str], *, base_model: str | None = None) -> Path:
    """Writes `adapter_config.json` + `adapter_model.safetensors`, loadable by
    `peft.PeftModel.from_pretrained` onto the base `transformers` model and by vLLM's LoRA path."""
    found = adapted(model)
    if not found:
        raise LoraError("the model has no adapters to save")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = describe(model)
    assert spec is not None
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec["rank"],
        "lora_alpha": spec["alpha"],
        "lora_dropout": 0.0,
        "target_modules": spec["targets"],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    save_file(peft_tensors(model), out / ADAPTER_WEIGHTS_FILE)
    (out / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_peft(model: CausalLM, adapter_dir: str | os.PathLike[str], *, mesh: Mesh | None = None) -> CausalLM:
    """Adds the PEFT adapter in `adapter_dir` to `model` (its base) and returns it. Only what
    `save_peft` writes is taken: plain LoRA on a list of projection names; DoRA, rsLoRA,
    per-module ranks or a tensor the model has no place for are refused by name."""
    adapter_dir = Path(adapter_dir)
    config_file, weights = adapter_dir / ADAPTER_CONFIG_FILE, adapter_dir / ADAPTER_WEIGHTS_FILE
    if not config_file.is_file() or not weights.is_file():
        raise LoraError(f"{adapter_dir}: a PEFT adapter needs adapter_config.json and adapter_model.safetensors")
    config = json.loads(config_file.read_text())
    unsupported = {
        "peft_type": config.get("peft_type") != "LORA",
        "use_dora": bool(config.get("use_dora")),
        "use_rslora": bool(config.get("use_rslora")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "target_modules": not isinstance(config.get("target_modules"), list),
        "bias": config.get("bias", "none") != "none",
    }
    bad = [key for key, refused in unsupported.items() if refused]
    if bad:
        raise LoraError(f"{config_file}: not supported: {', '.join(f'{k}={config.get(k)!r}' for k in bad)}")
    add_adapters(model, rank=int(config["r"]), alpha=float(config["lora_alpha"]), targets=config["target_modules"],
                 seed=0, mesh=mesh)  # fmt: skip
    tensors = SafetensorsFile(weights)
    expected = set()
    for stem, module in adapted(model):
        template = tensor_map((*stem, "weight")).template.removesuffix(".weight")
        for part, var in (("lora_A", module.lora_a), ("lora_B", module.lora_b)):
            assert var is not None
            value = var.get_value()
            names = [f"{PEFT_PREFIX}{template.format(layer=i)}.{part}.weight" for i in range(value.shape[0])]
            missing = [n for n in names if n not in tensors.keys()]
            if missing:
                raise LoraError(f"{weights}: tensor {missing[0]} missing")
            stacked = np.empty(value.shape, np.float32)
            for i, name in enumerate(names):
                if tensors.shape(name) != value.shape[1:]:
                    raise LoraError(
                        f"{weights}: {name} has shape {tensors.shape(name)}, the model needs {value.shape[1:]}"
                    )
                tensors.read_into(name, (), stacked[i])
            var.set_value(jax.device_put(stacked, value.sharding))
            expected.update(names)
    unused = sorted(set(tensors.keys()) - expected)
    if unused:
        raise LoraError(f"{weights}: tensors the model has no place for: {unused[:3]}")
    return model
