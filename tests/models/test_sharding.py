"""Partition rules, and sharded loading on 8 fake CPU devices (in a subprocess,
because the device count is fixed when jax is first imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from legorl_jax.models import MESH_AXES, partition_spec

_CHECK = Path(__file__).with_name("sharded_load_check.py")
_REPO = Path(__file__).resolve().parents[2]


def _run_sharded(checkpoint: Path, sizes: str) -> dict:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": f"{_REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    proc = subprocess.run(
        [sys.executable, str(_CHECK), str(checkpoint), sizes], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("arch", "sizes"), [("qwen3_untied", "2,2,2,1"), ("qwen3_moe", "1,2,2,2")])
def test_sharded_load_gives_single_device_logits(
    arch: str, sizes: str, tiny_hf_checkpoint: Callable[[str], Path]
) -> None:
    result = _run_sharded(tiny_hf_checkpoint(arch), sizes)
    assert result["devices"] == 8
    assert result["max_diff"] <= 1e-5
    # Tensors really are split: each device holds only its block.
    full, local = result["shard_shapes"]["layers/self_attn/q_proj/weight"]
    assert local == [full[0], full[1] // 2, full[2] // 2]
    if arch == "qwen3_moe":
        assert result["specs"]["layers/mlp/gate_proj"] == [None, "expert", "tensor", "fsdp"]
        full, local = result["shard_shapes"]["layers/mlp/down_proj"]
        assert local == [full[0], full[1] // 2, full[2] // 2, full[3] // 2]


def test_partition_rules() -> None:
    mesh = AbstractMesh((1, 4, 2, 2), MESH_AXES)
    # Linear weights are [out, in] (HF layout).
    assert partition_spec(("layers", "self_attn", "q_proj", "weight"), (2, 96, 64), mesh) == PartitionSpec(
        None, "tensor", "fsdp"
    )
    assert partition_spec(("layers", "mlp", "down_proj"), (2, 8, 64, 32), mesh) == PartitionSpec(
        None, "expert", "fsdp", "tensor"
    )
    assert partition_spec(("embed_tokens", "embedding"), (256, 64), mesh) == PartitionSpec("tensor", "fsdp")
    # A dimension the mesh axis does not divide stays replicated.
    assert partition_spec(("lm_head", "embedding"), (255, 64), mesh) == PartitionSpec(None, "fsdp")
    with pytest.raises(KeyError, match="no partition rule for parameter 'layers/mystery/weight'"):
        partition_spec(("layers", "mystery", "weight"), (2, 4, 4), mesh)


def test_make_mesh_validates_sizes() -> None:
    from legorl_jax.models import make_mesh

    mesh = make_mesh()
    assert mesh.axis_names == MESH_AXES
    with pytest.raises(ValueError, match="at most one -1"):
        make_mesh(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="needs 3 devices"):
        make_mesh(data=3, fsdp=1)
