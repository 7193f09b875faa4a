"""Ahead-of-time plans of a learner for a TPU slice (or GPU hosts), compiled on any machine.

libtpu's compiler runs without a TPU, and jax's CUDA plugin compiles without a
GPU given the GPU's description (`gpu_target`): a topology description gives the
slice's devices, the learner is built from shapes only (`Learner` over an
abstract model: nothing materialised), and the programs a real step runs are
lowered and compiled for those devices with the kernels the target would use
(splash attention by Mosaic on a TPU; `compile_target`). Per program the
compiler reports its memory per device (arguments, outputs, temporaries, code)
and, on a TPU, its cost (FLOPs, bytes); the step's FLOPs by the usual count (6
per parameter per token, plus attention and what remat repeats) against the
chips' published peaks (`chips`) give a roofline step time, the best the slice
could do.

Programs: the micro-step (the loss, its gradient and the token logprobs at one
micro-batch shape: every length bucket at its full row count, plain rows and,
with prefix sharing, tree rows) and the optimizer update. The resident state
(parameters, optimizer moments, reference policy, gradient accumulator) is
counted once in each program's arguments; the optimizer state, not an argument
of the micro-step, is added to its peak since it stays on the device.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl_jax.core.config import Config, cache_root
from legorl_jax.train.chips import GIB, Topology

# Set-up installs the compilers here, off the main environment's path, so that CPU runs never meet them.
LIBTPU_DIR = "libtpu"
LIBTPU_PIN = "0.0.42.1"  # the libtpu jax[tpu] 0.10.2 asks for
CUDA_PLUGIN_DIR = "jax-cuda12"
CUDA_PLUGIN_PIN = "0.10.2"  # jax-cuda12-plugin and -pjrt: the jax release's own
_COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


class PlanError(RuntimeError):
    """The plan cannot be made here (no compiler installed, an unknown topology, a mesh that does not fit it)."""


def use_compiler(platform: str) -> None:
    """Puts set-up's compiler for `platform` ("tpu": libtpu, "gpu": jax's CUDA plugin) on
    the import path and keeps this process on the CPU: the compiler is only used to
    compile here. Call before JAX is imported."""
    if "jax" in sys.modules and os.environ.get("JAX_PLATFORMS") != "cpu":
        raise PlanError("use_compiler() must run before jax is imported")
    os.environ["JAX_PLATFORMS"] = "cpu"
    if platform == "tpu":
        # Without these libtpu looks for a TPU VM's metadata and prints a warning per variable.
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
        # Only compiling: several plans (or a plan beside a test) may load libtpu at once.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if platform not in ("tpu", "gpu"):
        return
    installed = cache_root() / (LIBTPU_DIR if platform == "tpu" else CUDA_PLUGIN_DIR)
    if installed.is_dir() and str(installed) not in sys.path:
        sys.path.insert(0, str(installed))


def target_devices(topology: Topology) -> list[Any]:
    """Compile-only devices of `topology`: what the compiler lays programs out over."""
    from jax.experimental import topologies

    if topology.platform == "gpu":
        return _gpu_devices(topology)
    if topology.platform == "cpu":  # this machine itself: the method checked against a measured step
        import jax

        return jax.devices("cpu")[: topology.chips]
    try:
        import libtpu  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        raise PlanError(
            f"libtpu is not installed: run ./scripts/setup (it puts libtpu {LIBTPU_PIN} under "
            f"{cache_root() / LIBTPU_DIR}) or pip install libtpu=={LIBTPU_PIN}"
        ) from None
    # A v4 or v5p chip's two TensorCores run as one device (megacore), as on a real
    # slice; libtpu otherwise describes v4 by TensorCore, over which jax builds no mesh.
    options = {"chip_config_name": "megacore"} if topology.chip.cores_per_chip_in_name == 2 else {}
    try:
        return list(topologies.get_topology_desc(topology_name=topology.name, platform="tpu", **options).devices)
    except Exception as exc:  # libtpu's own error type is not public
        raise PlanError(f"libtpu has no topology {topology.name}: {exc}") from exc


def _gpu_devices(topology: Topology) -> list[Any]:
    from jax.experimental import topologies

    from legorl_jax.train.gpu_target import target_config

    try:
        import jax_plugins.xla_cuda12  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        raise PlanError(
            f"jax's CUDA plugin is not installed: run ./scripts/setup (it puts jax-cuda12-plugin "
            f"{CUDA_PLUGIN_PIN} under {cache_root() / CUDA_PLUGIN_DIR})"
        ) from None
    hosts, per_host = topology.shape
    try:
        # The plugin's shape is partitions x hosts per partition x devices per host.
        desc = topologies.get_topology_desc(
            platform="cuda", topology=f"1x{hosts}x{per_host}", target_config=target_config(topology.chip)
        )
    except Exception as exc:  # JaxRuntimeError, whose import path moves between JAX releases
        raise PlanError(f"the CUDA plugin made no {topology.name} topology: {exc}") from exc
    return list(desc.devices)


@dataclass
class Program:
    name: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    # Per device, as XLA's cost analysis counts the program: a loop body once, so the scanned
    # layers count as one layer. Shown as XLA gives them; the step's FLOPs come from the model.
    flops: float
    bytes_accessed: float
    collectives: dict[str, int]
    kernels: list[str]  # custom calls in the program (tpu_custom_call: a Mosaic kernel such as splash)
    resident_extra_bytes: int = 0  # state on the device that is not an argument (the optimizer's, in a micro-step)
    refused: str = ""  # the compiler's refusal, when it would not compile the program for want of HBM

    @property
    def peak_bytes(self) -> int:
        live = self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
        return live + self.code_bytes + self.resident_extra_bytes


@dataclass
class Plan:
    topology: Topology
    devices: int
    mesh: dict[str, int]
    programs: list[Program]
    micro_steps_per_step: int  # at the largest bucket, the step's whole batch
    model_flops_per_step: float  # 6·N·tokens + attention, the MFU convention
    recompute: float  # hardware FLOPs per model FLOP: 4/3 when remat repeats every forward pass
    tokens_per_step: int
    link_bytes_per_step: float  # per device, sent over the chips' links (`_link_bytes`)
    compile_s: float
    suggestions: list[str] = field(default_factory=list)

    @property
    def devices_per_chip(self) -> int:
        return self.devices // self.topology.chips

    @property
    def hbm_capacity_per_device(self) -> int:
        return self.topology.chip.hbm_bytes // self.devices_per_chip

    @property
    def hbm_peak_per_device(self) -> int:
        return max(p.peak_bytes for p in self.programs)

    @property
    def fits(self) -> bool:
        return self.hbm_peak_per_device <= self.hbm_capacity_per_device

    @property
    def flops_per_step(self) -> float:
        """FLOPs the chips execute in one step: the model's, plus the forward passes remat repeats."""
        return self.model_flops_per_step * self.recompute

    def bound_s(self) -> dict[str, float]:
        """Seconds a step needs at each resource's peak: the chips' FLOP/s ("FLOPs"), HBM
        bandwidth (XLA's per-device bytes of each program, which count the scanned layers
        once: a lower bound; none for a GPU compiled without one) and the links between
        chips ("ICI": the collectives' bytes by `_link_bytes`, at half the published
        bidirectional figure per chip, i.e. one way)."""
        chip = self.topology.chip
        per_chip = self.devices_per_chip
        micro = max(p.bytes_accessed for p in self.programs if p.name.startswith("micro_step"))
        update = sum(p.bytes_accessed for p in self.programs if p.name == "optimizer_update")
        return {
            "FLOPs": self.flops_per_step / (chip.bf16_flops * self.topology.chips),
            "HBM bandwidth": (self.micro_steps_per_step * micro + update) / (chip.hbm_bandwidth / per_chip),
            "ICI": self.link_bytes_per_step / (self.topology.link_bandwidth / 2 / per_chip),
        }

    @property
    def limit(self) -> str:
        bounds = self.bound_s()
        return max(bounds, key=lambda k: bounds[k])

    @property
    def estimated_step_s(self) -> float:
        """The roofline bound: the longest of `bound_s`. A best case: it assumes the
        three overlap perfectly, and kernel efficiency and host work only add to it."""
        return max(self.bound_s().values())

    @property
    def estimated_mfu(self) -> float:
        peak = self.topology.chip.bf16_flops * self.topology.chips
        return self.model_flops_per_step / (peak * self.estimated_step_s)

    def summary(self) -> dict[str, Any]:
        return {
            "topology": self.topology.name,
            "platform": self.topology.platform,
            "devices": self.devices,
            "chips": self.topology.chips,
            "mesh": self.mesh,
            "fits": self.fits,
            "hbm_peak_bytes_per_device": self.hbm_peak_per_device,
            "hbm_capacity_bytes_per_device": self.hbm_capacity_per_device,
            "flops_per_step": self.flops_per_step,
            "recompute": self.recompute,
            "model_flops_per_step": self.model_flops_per_step,
            "tokens_per_step": self.tokens_per_step,
            "micro_steps_per_step": self.micro_steps_per_step,
            "estimated_step_s": self.estimated_step_s,
            "bound_s": self.bound_s(),
            "limit": self.limit,
            "link_bytes_per_step": self.link_bytes_per_step,
            "estimated_mfu": self.estimated_mfu,
            "tokens_per_s_per_chip": self.tokens_per_step / self.estimated_step_s / self.topology.chips,
            "compile_s": self.compile_s,
            "suggestions": self.suggestions,
            "programs": [{**vars(p), "peak_bytes": p.peak_bytes} for p in self.programs],
        }


# The compiler's refusals for want of HBM, in the two wordings libtpu uses: the temporaries it
# needed, or all it would have used ("Ran out of memory in memory space hbm. Used 16.05G of 15.75G").
_OVER_HBM = re.compile(r"RESOURCE_EXHAUSTED.*?(?:temporaries \(|memory space hbm\. Used )([\d.]+)([KMGT])")


def _compile(name: str, lowered: Any, resident_extra_bytes: int) -> Program:
    """The compiled program's figures; one the compiler refuses for want of HBM becomes a
    program that does not fit, with the temporaries the compiler said it needed."""
    try:
        return _program(name, lowered.compile(), resident_extra_bytes)
    except Exception as exc:  # JaxRuntimeError, whose import path moves between JAX releases
        match = _OVER_HBM.search(str(exc))
        if match is None:
            raise
        temp = int(float(match.group(1)) * 1024 ** "KMGT".index(match.group(2)) * 1024)
        try:
            cost = lowered.cost_analysis() or {}
        except Exception:  # not every backend estimates uncompiled programs; the figures stay 0
            cost = {}
        cost = cost[0] if isinstance(cost, list) else cost
        return Program(
            name=name,
            argument_bytes=0,
            output_bytes=0,
            alias_bytes=0,
            temp_bytes=temp,
            code_bytes=0,
            flops=float(cost.get("flops", 0.0)),
            bytes_accessed=float(cost.get("bytes accessed", 0.0)),
            collectives={},
            kernels=[],
            resident_extra_bytes=resident_extra_bytes,
            refused=str(exc).splitlines()[0][:300],
        )


def _program(name: str, compiled: Any, resident_extra_bytes: int = 0) -> Program:
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}  # the CUDA plugin's compile-only programs give none
    cost = cost[0] if isinstance(cost, list) else cost
    text = compiled.as_text()
    collectives: dict[str, int] = {}
    for kind in _COLLECTIVE.findall(text):
        collectives[kind] = collectives.get(kind, 0) + 1
    kernels = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    return Program(
        name=name,
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        code_bytes=int(memory.generated_code_size_in_bytes),
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        collectives=collectives,
        kernels=kernels,
        resident_extra_bytes=resident_extra_bytes,
    )


def _device_bytes(tree: Any) -> int:
    """Bytes one device holds of a pytree of sharded shapes (the largest shard of each leaf)."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * leaf.dtype.itemsize
    return total


def _model_flops(model_config: Any, params: int, tokens: int, seq_len: int) -> float:
    """Training FLOPs by the usual convention: 6 per active parameter per token, plus causal
    attention's 6·layers·heads·head_dim·seq per token (forward and backward, half the square)."""
    active = params
    if model_config.num_experts:
        per_expert = 3 * model_config.hidden_size * model_config.moe_intermediate_size * model_config.num_layers
        active = params - per_expert * (model_config.num_experts - model_config.num_experts_per_tok)
    attention = 6 * model_config.num_layers * model_config.num_heads * model_config.head_dim * seq_len
    return float(tokens * (6 * active + attention))


def _link_bytes(
    model_config: Any,
    params: int,
    mesh: dict[str, int],
    tokens_per_device: int,
    remat: str,
    param_itemsize: int,
    compute_itemsize: int,
) -> float:
    """Bytes one device sends over the links in one micro-step, by the sharding's
    usual collectives (ring algorithms: each device sends (n-1)/n of the data):
    fsdp gathers the parameters for the forward and again for the backward pass and
    reduce-scatters the f32 gradients, which replicas on the data axis then
    all-reduce; tensor parallelism all-reduces each layer's attention and MLP outputs
    in every forward and backward pass (three passes with remat). Expert
    parallelism's token exchange is not counted: a lower bound for MoE."""
    data, fsdp, tensor = mesh.get("data", 1), mesh.get("fsdp", 1), mesh.get("tensor", 1)
    shard = params / (tensor * mesh.get("expert", 1) if model_config.num_experts else tensor)
    out = (2 * shard * param_itemsize + shard * 4) * (fsdp - 1) / fsdp
    out += 2 * shard * 4 / fsdp * (data - 1) / data
    if tensor > 1:
        passes = 6 if remat == "full" else 4
        activation = tokens_per_device * model_config.hidden_size * compute_itemsize
        out += model_config.num_layers * passes * activation * 2 * (tensor - 1) / tensor
    return out


def plan_learner(
    cfg: Config, hf_config: dict[str, Any], topology: Topology, progress: Callable[[str], None] = print
) -> Plan:
    """Compiles the learner of `cfg` (architecture from `hf_config`) for `topology`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from legorl_jax.models import batch_sharding
    from legorl_jax.models.attention import compile_target
    from legorl_jax.models.config import from_hf_config
    from legorl_jax.rl.batching import rows_per_micro_batch
    from legorl_jax.train.sharding import data_parallel_size, learner_mesh
    from legorl_jax.train.step import Learner

    devices = target_devices(topology)
    try:
        mesh = learner_mesh(cfg.learner.mesh, devices)
    except ValueError as exc:
        raise PlanError(f"learner.mesh on {topology.name} ({len(devices)} devices): {exc}") from exc
    model_config = from_hf_config(
        hf_config,
        param_dtype=cfg.model.param_dtype,
        compute_dtype=cfg.model.compute_dtype,
        remat=cfg.model.remat,
        attention_kernel=cfg.model.attention_kernel,
    )
    started = time.monotonic()
    programs: list[Program] = []
    with compile_target(topology.platform):
        model = nnx.eval_shape(lambda: _policy(model_config, cfg.model.lora))
        learner = Learner(model, cfg.rl, cfg.learner, mesh)
        acc = learner._zero_acc.eval_shape()
        aux = jax.ShapeDtypeStruct((), jnp.float32)
        dp = data_parallel_size(mesh)
        sharding = batch_sharding(mesh)
        opt_bytes = _device_bytes(learner.opt_state)
        shapes = [
            (b, tree) for b in cfg.learner.length_buckets for tree in (False, True)[: 1 + cfg.learner.share_prefixes]
        ]
        for bucket, tree in shapes:
            try:
                rows = rows_per_micro_batch(bucket, cfg.learner.micro_batch_tokens, dp)
            except ValueError as exc:  # a budget that holds no row per data-parallel shard
                raise PlanError(f"on {topology.name} with mesh {dict(mesh.shape)}: {exc}") from None
            name = f"micro_step[{rows}x{bucket}{', tree rows' if tree else ''}]"
            progress(f"compiling {name} for {topology.name}")
            batch = _abstract_batch(rows, bucket, tree, sharding)
            with jax.set_mesh(mesh):
                lowered = learner._micro.lower(learner.params, learner.frozen, learner.ref_params, acc, batch, aux)
            programs.append(_compile(name, lowered, opt_bytes))
        progress(f"compiling optimizer_update for {topology.name}")
        normaliser = jax.ShapeDtypeStruct((), jnp.float32)
        lowered = learner._apply.lower(learner.params, learner.opt_state, acc["grads"], normaliser)
        programs.append(_compile("optimizer_update", lowered, 0))
    compile_s = time.monotonic() - started

    longest = max(cfg.learner.length_buckets)
    sequences = cfg.rl.groups_per_step * cfg.rl.group_size
    rows = rows_per_micro_batch(longest, cfg.learner.micro_batch_tokens, dp)
    micro_steps = math.ceil(sequences / rows)
    tokens = micro_steps * rows * longest
    # With LoRA the frozen base still runs forward and backward and is gathered like trained
    # weights: FLOPs and links are priced as full fine-tuning's, an upper bound (no weight
    # gradient for the base, and only the adapters' gradients are reduced).
    params = sum(math.prod(x.shape) for x in jax.tree.leaves((learner.params, learner.frozen)))
    mesh_shape = {k: int(v) for k, v in mesh.shape.items()}
    link = _link_bytes(
        model_config,
        params,
        mesh_shape,
        rows * longest // dp,
        cfg.model.remat,
        jnp.dtype(cfg.model.param_dtype).itemsize,
        jnp.dtype(cfg.model.compute_dtype).itemsize,
    )
    result = Plan(
        topology=topology,
        devices=len(devices),
        mesh=mesh_shape,
        programs=programs,
        micro_steps_per_step=micro_steps,
        model_flops_per_step=_model_flops(model_config, params, tokens, longest),
        recompute=4 / 3 if cfg.model.remat == "full" else 1.0,
        tokens_per_step=tokens,
        link_bytes_per_step=micro_steps * link,
        compile_s=compile_s,
    )
    if not result.fits:
        result.suggestions = _suggestions(cfg, result)
    return result


def _policy(model_config: Any, lora: Any) -> Any:
    """The model the learner trains: with the config's adapters when it has them."""
    from flax import nnx

    from legorl_jax.models import CausalLM
    from legorl_jax.models.lora import add_adapters

    model = CausalLM(model_config, rngs=nnx.Rngs(0))
    if lora is not None:
        add_adapters(model, rank=lora.rank, alpha=lora.alpha, targets=list(lora.targets), seed=0)
    return model


def _suggestions(cfg: Config, plan: Plan) -> list[str]:
    """What would shrink the peak, from what the plan shows dominates it."""
    worst = max(plan.programs, key=lambda p: p.peak_bytes)
    out = []
    state = worst.argument_bytes + worst.resident_extra_bytes
    if state > plan.hbm_capacity_per_device // 2:
        out.append(
            f"the state is {state / GIB:.1f} GiB per device: shard it wider (learner.mesh.fsdp over more "
            "devices, a bigger slice) or keep bfloat16 parameters (model.param_dtype)"
        )
    if worst.temp_bytes > plan.hbm_capacity_per_device // 4:
        if cfg.model.remat != "full":
            out.append(f"activations take {worst.temp_bytes / GIB:.1f} GiB: model.remat=full recomputes them")
        out.append(
            f"a smaller micro-batch (learner.micro_batch_tokens, now {cfg.learner.micro_batch_tokens}) "
            "holds fewer activations"
        )
    return out


def _abstract_batch(rows: int, bucket: int, tree: bool, sharding: Any) -> dict[str, Any]:
    """A micro-batch's shapes as `MicroBatch` lays them out: model inputs [R, T], loss inputs [R, T-1]."""
    import jax
    import jax.numpy as jnp

    from legorl_jax.train.step import BATCH_KEYS, FLOAT_KEYS

    def shape(cols: int, dtype: Any) -> Any:
        return jax.ShapeDtypeStruct((rows, cols), dtype, sharding=sharding)

    batch = {k: shape(bucket, jnp.int32) for k in ("tokens", "positions", "segment_ids")}
    batch.update({k: shape(bucket - 1, jnp.float32) for k in FLOAT_KEYS})
    batch["seq_ids"] = shape(bucket - 1, jnp.int32)
    if tree:
        batch.update(kv_end=shape(bucket, jnp.int32), pred_from=shape(bucket - 1, jnp.int32))
    assert set(BATCH_KEYS) <= set(batch)
    return batch


def read_hf_config(path: str | Path) -> dict[str, Any]:
    import json

    file = Path(path)
    file = file / "config.json" if file.is_dir() else file
    try:
        return dict(json.loads(file.read_text()))
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read the model's config.json at {file}: {exc}") from exc
