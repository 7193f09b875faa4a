"""The learner with LoRA adapters: only the adapters train (gradient checked against
finite differences), the base stays bit-identical, and a checkpoint holds and restores
exactly the adapters and their optimizer state."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from pydantic import ValidationError
from tiny import learner_config, random_sequences, rl_config, tiny_model

from legorl_jax.cli import main
from legorl_jax.core.config import CONFIG_DIR, CheckpointConfig, LoraConfig, MeshConfig, load_config
from legorl_jax.models import CausalLM, from_hf, to_hf
from legorl_jax.models.lora import adapted, add_adapters, load_peft, merged_weight
from legorl_jax.train.checkpoint import Checkpointer, CheckpointMismatch
from legorl_jax.train.loop import policy_model
from legorl_jax.train.sharding import learner_mesh
from legorl_jax.train.step import Learner

TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    return learner_mesh(MeshConfig())


def _adapted_model(seed: int = 0) -> CausalLM:
    """A tiny model with adapters whose B is drawn too, so A has a gradient from the first step."""
    model = tiny_model(seed)
    add_adapters(model, rank=4, alpha=8, targets=TARGETS, seed=seed)
    key = jax.random.key(seed + 1)
    for _, module in adapted(model):
        key, sub = jax.random.split(key)
        module.lora_b.set_value(0.1 * jax.random.normal(sub, module.lora_b.get_value().shape))
    return model


def _flat(tree: dict) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_only_adapters_train_and_the_base_stays_bit_identical(mesh: jax.sharding.Mesh) -> None:
    learner = Learner(_adapted_model(), rl_config(), learner_config(), mesh)
    assert learner.lora
    trained = _flat(learner.params)
    assert trained and all(k.endswith(("['lora_a']", "['lora_b']")) for k in trained)
    # The optimizer holds moments of the adapters only.
    moments = sum(x.size for x in jax.tree.leaves(learner.opt_state) if x.ndim > 0)
    assert moments == 2 * sum(x.size for x in trained.values())
    base = _flat(learner.frozen)
    assert "['layers']['self_attn']['q_proj']['weight']" in "".join(base)
    packed = learner.pack(random_sequences(3, 12))
    metrics = learner.train_step(packed)
    assert metrics["grad_norm"] > 0
    after = _flat(learner.params)
    assert all(not np.array_equal(after[k], trained[k]) for k in trained)
    for k, v in _flat(learner.frozen).items():
        assert np.array_equal(v, base[k]), k


def test_the_adapter_gradient_matches_finite_differences(mesh: jax.sharding.Mesh) -> None:
    """The directional derivative of the step's loss numerator along a random direction
    over every adapter weight, against a central difference in float32. Clip ranges and
    importance caps are wide open: a kink of the loss between the two probes is no test."""
    smooth = rl_config(clip_low=0.999, clip_high=1e3, tis_cap=1e6, mis_cap=1e6)
    learner = Learner(_adapted_model(2), smooth, learner_config(), mesh)
    packed = learner.pack(random_sequences(4, 8))
    grads, _, _ = learner.accumulate(packed)
    keys = iter(jax.random.split(jax.random.key(9), len(jax.tree.leaves(learner.params))))
    direction = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape), learner.params)
    analytic = sum(
        float(jnp.vdot(g, d)) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direction), strict=True)
    )
    start = jax.tree.map(jnp.copy, learner.params)

    def numerator(sign: float) -> float:
        learner.params = jax.tree.map(lambda p, d: p + sign * 1e-3 * d, start, direction)
        return float(learner.accumulate(packed)[1])

    numeric = (numerator(1.0) - numerator(-1.0)) / 2e-3
    assert abs(analytic) > 1e-3
    assert numeric == pytest.approx(analytic, rel=2e-2)


def test_a_checkpoint_restores_the_adapters_and_their_moments_exactly(tmp_path: Path, mesh: jax.sharding.Mesh) -> None:
    learner = Learner(_adapted_model(), rl_config(), learner_config(), mesh)
    packed = learner.pack(random_sequences(3, 12))
    learner.train_step(packed)
    ckpt = Checkpointer(tmp_path, CheckpointConfig(every_steps=1, keep=2, async_save=False))
    assert ckpt.save(learner, policy_version=1, rng=jax.random.key(0))
    resumed = Learner(_adapted_model(), rl_config(), learner_config(), mesh)
    state = ckpt.restore_latest(resumed)
    assert state is not None and resumed.step == 1
    for mine, theirs in ((learner.params, resumed.params), (learner.opt_state, resumed.opt_state)):
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    learner.train_step(packed)
    resumed.train_step(packed)
    for a, b in zip(jax.tree.leaves(learner.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    full = Learner(tiny_model(), rl_config(), learner_config(), mesh)
    with pytest.raises(
        CheckpointMismatch, match=r"trained LoRA adapters \{'rank': 4, .* and this run's model.lora trains every weight"
    ):
        ckpt.restore_latest(full)
    ckpt.close()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dropout": 0.1}, "dropout must be 0"),
        ({"experts": True}, "experts: true is not supported yet"),
        ({"targets": ["q_proj", "q_proj"]}, "duplicates"),
        ({"targets": ["qkv"]}, "targets.0"),
        ({"rank": 0}, "rank"),
    ],
)
def test_bad_lora_configs_name_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        LoraConfig(**fields)


def test_an_adapted_policy_exports_merged_weights(mesh: jax.sharding.Mesh) -> None:
    """`Learner.model()` keeps the adapters; its logits equal those of the merged weights."""
    learner = Learner(_adapted_model(), rl_config(), learner_config(), mesh)
    policy = learner.model()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (1, 24)), jnp.int32)
    for _, module in adapted(policy):
        module.weight.set_value(merged_weight(module))
        module.lora_a, module.lora_b = nnx.data(None), nnx.data(None)
    merged = policy(tokens)
    assert np.abs(np.asarray(learner.model()(tokens)) - np.asarray(merged)).max() < 1e-5


def test_a_lora_checkpoint_converts_to_peft_and_to_merged_weights(tmp_path: Path, mesh: jax.sharding.Mesh) -> None:
    """`legorl convert` takes a LoRA run's checkpoint (adapters only) onto its base model."""
    base = to_hf(tiny_model(), tmp_path / "base")
    model = from_hf(base)
    add_adapters(model, rank=4, alpha=8, targets=TARGETS, seed=0)
    learner = Learner(model, rl_config(), learner_config(), mesh)
    learner.train_step(learner.pack(random_sequences(3, 12)))
    ckpt = Checkpointer(tmp_path / "ckpt", CheckpointConfig(every_steps=1, keep=1, async_save=False))
    ckpt.save(learner, policy_version=1, rng=jax.random.key(0))
    ckpt.close()
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 128, (1, 24)), jnp.int32)
    want = np.asarray(learner.model()(tokens))
    common = ["convert", "--from-orbax", str(tmp_path / "ckpt"), "--config-from", str(base)]
    assert main([*common, "--to-peft", str(tmp_path / "peft")]) == 0
    assert np.abs(np.asarray(load_peft(from_hf(base), tmp_path / "peft")(tokens)) - want).max() < 1e-5
    assert main([*common, "--to-hf", str(tmp_path / "merged")]) == 0
    assert np.abs(np.asarray(from_hf(tmp_path / "merged")(tokens)) - want).max() < 1e-5


def test_a_run_config_with_lora_builds_an_adapted_policy(tmp_path: Path, mesh: jax.sharding.Mesh) -> None:
    """What `legorl train` builds from `model.lora`: the checkpoint with adapters on the targets, trained alone."""
    base = to_hf(tiny_model(), tmp_path / "base")
    config = load_config(CONFIG_DIR / "demo_lora.yaml")
    model = policy_model(config, base, mesh)
    lora = config.model.lora
    assert lora is not None
    assert sorted(stem[-1] for stem, _ in adapted(model)) == sorted(lora.targets)
    assert Learner(model, config.rl, config.learner, mesh).lora_spec == {
        "rank": lora.rank,
        "alpha": lora.alpha,
        "targets": sorted(lora.targets),
    }
