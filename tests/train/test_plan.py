"""`legorl plan`: the learner compiled for a TPU slice by libtpu on this CPU machine.

The compiles run in a `legorl plan` subprocess, as a user runs it: libtpu must be on
the path before JAX starts, and this test process's JAX is already up on the CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from legorl_jax.core.config import REPO_ROOT
from legorl_jax.train.chips import parse_topology


@pytest.mark.parametrize(
    "name, libtpu_name, chips",
    [
        ("v5p-8", "v5p:2x2x1", 4),  # v5p and v4 slices count TensorCores, two per chip
        ("v5p-64", "v5p:2x4x4", 32),
        ("v4-32", "v4:2x2x4", 16),
        ("v6e-64", "v6e:8x8", 64),  # v5e and v6e count chips
        ("v5e-8", "v5e:2x4", 8),
        ("v5p:4x4x2", "v5p:4x4x2", 32),
        ("h100-8", "h100:1x8", 8),  # GPUs by count: hosts x GPUs per host
        ("h100-4", "h100:1x4", 4),
        ("h100-64", "h100:8x8", 64),
    ],
)
def test_slice_names_become_libtpu_topologies(name: str, libtpu_name: str, chips: int) -> None:
    topology = parse_topology(name)
    assert (topology.name, topology.chips) == (libtpu_name, chips)


@pytest.mark.parametrize("bad", ["v5p", "v7x-8", "v5p-7", "v6e:4x4x4", "v5p-24", "tpu-8", "h100-12", "h100-0"])
def test_bad_slice_names_are_refused_with_examples(bad: str) -> None:
    with pytest.raises(ValueError, match="topology"):
        parse_topology(bad)


def _plan(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    out = tmp_path / "plan.json"
    run = subprocess.run(
        [sys.executable, "-m", "legorl_jax.cli", "plan", *args, "--json", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert run.returncode in (0, 1), run.stderr[-3000:]
    return run.returncode, json.loads(out.read_text()), run.stdout


# A small Qwen3 with the shapes splash takes: head_dim 128, a 1,024-token row.
SMALL = {
    "model_type": "qwen3",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def _small_plan(tmp_path: Path, topology: str, *overrides: str) -> tuple[int, dict[str, Any], str]:
    """`legorl plan` of SMALL on `topology` at 1,024-token rows in bf16, with `overrides` (--set)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL))
    sets = ["learner.length_buckets=[1024]", "model.compute_dtype=bfloat16", *overrides]
    return _plan(
        tmp_path, "--topology", topology, "--model-config", str(config), *(a for o in sets for a in ("--set", o))
    )


@pytest.mark.libtpu
def test_a_small_qwen3_step_compiles_for_a_v5p_slice_with_splash(tmp_path: Path) -> None:
    code, plan, stdout = _small_plan(tmp_path, "v5p-8", "learner.micro_batch_tokens=4096")
    assert code == 0 and plan["fits"] and plan["platform"] == "tpu" and plan["devices"] == 4
    programs = {p["name"]: p for p in plan["programs"]}
    assert set(programs) == {"micro_step[4x1024]", "micro_step[4x1024, tree rows]", "optimizer_update"}
    # Plain rows run splash attention, a Mosaic kernel compiled for the TPU; tree rows (a
    # prefix-chain mask splash cannot express) run the blockwise kernel in plain XLA.
    assert "tpu_custom_call" in programs["micro_step[4x1024]"]["kernels"]
    assert "tpu_custom_call" not in programs["micro_step[4x1024, tree rows]"]["kernels"]
    # fsdp over the four chips: parameters are gathered and gradients reduced.
    assert programs["micro_step[4x1024]"]["collectives"]
    assert 0 < plan["hbm_peak_bytes_per_device"] < plan["hbm_capacity_bytes_per_device"] == 95 * 2**30
    assert plan["flops_per_step"] > 0 and plan["estimated_step_s"] > 0 and 0 < plan["estimated_mfu"] < 1
    assert "fits" in stdout


@pytest.mark.libtpu
@pytest.mark.slow
def test_the_qwen3_8b_config_fits_its_v5p_slice(tmp_path: Path) -> None:
    """The shipped config on its slice. Only the longest bucket is compiled (a minute or more
    per program here): every bucket's micro-batch holds the same tokens, and the longest
    row needs the most attention memory; `legorl plan` without the --set compiles them all."""
    code, plan, stdout = _plan(
        tmp_path,
        "--config",
        str(REPO_ROOT / "configs" / "qwen3_8b_v5p.yaml"),
        "--topology",
        "v5p-64",
        "--model-config",
        str(REPO_ROOT / "configs" / "hf" / "qwen3-8b.json"),
        "--set",
        "learner.length_buckets=[32768]",
    )
    assert code == 0 and plan["fits"], stdout
    assert plan["chips"] == 32 and plan["hbm_peak_bytes_per_device"] < plan["hbm_capacity_bytes_per_device"]
    assert len(plan["programs"]) == 3  # plain rows, tree rows, the optimizer update


@pytest.mark.libtpu
def test_a_small_qwen3_step_compiles_for_h100_hosts_without_a_gpu(tmp_path: Path) -> None:
    """jax's CUDA plugin compiles for two 8-GPU hosts given the GPU's description: memory
    per GPU is reported, the link bound uses the hosts' NICs, and the roofline counts FLOPs
    (the plugin gives no cost analysis without a GPU)."""
    code, plan, stdout = _small_plan(
        tmp_path, "h100-16", "learner.micro_batch_tokens=16384", "learner.share_prefixes=false"
    )
    assert code == 0 and plan["fits"] and plan["platform"] == "gpu" and plan["devices"] == 16
    assert {p["name"] for p in plan["programs"]} == {"micro_step[16x1024]", "optimizer_update"}
    assert 0 < plan["hbm_peak_bytes_per_device"] < plan["hbm_capacity_bytes_per_device"] == 80 * 10**9
    assert plan["bound_s"]["HBM bandwidth"] == 0 and plan["bound_s"]["FLOPs"] > 0 and plan["bound_s"]["ICI"] > 0
    assert "no cost analysis" in stdout


@pytest.mark.parametrize(
    "message, gib",
    [
        # v5e-32 refusing Qwen3-8B's 32k rows (libtpu 0.0.42.1's wording)
        ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran out of memory "
         "in memory space hbm. Used 16.05G of 15.75G hbm. Exceeded hbm capacity by 306.38M.", 16.05),
        ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm; "
         "temporaries (138.2G) exceed the capacity", 138.2),
    ],
)  # fmt: skip
def test_compiler_hbm_refusals_are_read_as_not_fitting(message: str, gib: float) -> None:
    from legorl_jax.train.plan import _OVER_HBM

    match = _OVER_HBM.search(message)
    assert match is not None and (float(match.group(1)), match.group(2)) == (gib, "G")


_MESHES = """
from legorl_jax.train.plan import target_devices, use_compiler
use_compiler("tpu")
from legorl_jax.models import make_mesh
from legorl_jax.train.chips import parse_topology
v4 = target_devices(parse_topology("v4-16"))
print(len(v4), dict(make_mesh(1, -1, 4, 1, devices=v4).shape))
v6e = target_devices(parse_topology("v6e-64"))
print(len(v6e), dict(make_mesh(1, -1, 4, 1, devices=v6e).shape))
"""


@pytest.mark.libtpu
def test_v4_and_a_v6e_8x8_take_a_tensor_parallel_mesh() -> None:
    """A v4 slice is one device per chip (megacore), as on a real v4; fsdp 16 x tensor 4
    on v6e's 8x8 torus needs a mesh axis laid over part of a physical one."""
    out = subprocess.run([sys.executable, "-c", _MESHES], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()[-2:]
    assert lines[0] == "8 {'data': 1, 'fsdp': 2, 'tensor': 4, 'expert': 1}"
    assert lines[1] == "64 {'data': 1, 'fsdp': 16, 'tensor': 4, 'expert': 1}"


@pytest.mark.libtpu
def test_a_lora_config_plans_the_adapters_it_trains(tmp_path: Path) -> None:
    """model.lora is planned, not dropped: the optimizer update holds the adapters alone
    (SMALL's 1.7M parameters with Adam's moments and gradients would take 6.8 MB per chip)."""
    lora = "model.lora={rank: 8, targets: [q_proj, v_proj]}"
    code, plan, _ = _small_plan(
        tmp_path, "v5p-8", "learner.micro_batch_tokens=4096", "learner.share_prefixes=false", lora
    )
    assert code == 0 and plan["fits"]
    update = {program["name"]: program for program in plan["programs"]}["optimizer_update"]
    assert 0 < update["argument_bytes"] < 2**20
