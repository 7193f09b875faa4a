"""Prefix-shared (tree) packing trains exactly what unshared packing trains:
per-token logprobs, loss, gradients and metrics, dense and MoE, with and without
rematerialisation, over several micro-batches, for every policy loss and every
aggregation mode."""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
import pytest
from tiny import harness_groups, learner_config, rl_config, tiny_model

from legorl_jax.core.config import MeshConfig
from legorl_jax.models import token_logprobs
from legorl_jax.models.attention import resolve_kernel
from legorl_jax.rl.batching import PackedStep
from legorl_jax.train.sharding import learner_mesh
from legorl_jax.train.step import Learner

MOE = dict(architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    return learner_mesh(MeshConfig())


def _rel(a: object, b: object) -> float:
    return max(
        float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-12))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _logprobs_by_behaviour(learner: Learner, packed: PackedStep) -> dict[float, float]:
    """Learner logprob of every sampled token, keyed by its (unique) engine logprob."""
    out = {}
    for mb in packed.micro_batches:
        lp = token_logprobs(
            learner.model(),
            mb.tokens,
            positions=mb.positions,
            segment_ids=mb.segment_ids,
            kv_end=mb.kv_end,
            pred_from=mb.pred_from,
            chunk_size=learner.cfg.logprob_chunk_size,
        )
        on = mb.loss_mask > 0
        out.update(zip(mb.behavior_logprobs[on].tolist(), np.asarray(lp)[on].tolist(), strict=True))
    return out


def _train(
    mesh: jax.sharding.Mesh,
    share: bool,
    model_overrides: dict,
    bucket: int = 64,
    rows: int = 2,
    configs: int = 2,
    **rl: object,
) -> dict:
    cfg = learner_config(rows * bucket).model_copy(update={"share_prefixes": share, "length_buckets": [bucket]})
    learner = Learner(tiny_model(**model_overrides), rl_config(**rl), cfg, mesh)
    packed = learner.pack(harness_groups(configs=configs))
    logprobs = _logprobs_by_behaviour(learner, packed)
    grads, numerator, _ = learner.accumulate(packed)
    metrics = learner.train_step(packed)
    return {
        "packed": packed,
        "logprobs": logprobs,
        "grads": jax.device_get(grads),
        "numerator": float(numerator),
        "params": jax.device_get(learner.params),
        "metrics": metrics,
    }


# A minute or more each on a laptop-class CPU: all but one are left to the full suite (`slow`).
MODES = [
    pytest.param({}, dict(loss="ppo_clip", aggregation="token_mean", kl_coef=0.05), marks=pytest.mark.slow),
    pytest.param({"remat": "full"}, dict(loss="gspo", aggregation="seq_mean_token_mean"), marks=pytest.mark.slow),
    ({}, dict(loss="cispo", aggregation="constant", clip_low=1.0)),
    # The MoE router's balancing loss is a per-micro-batch statistic of computed tokens (like the
    # micro-batch split, packing changes it); the policy loss through the experts must not change.
    pytest.param(
        {**MOE, "router_aux_loss_coef": 0.0},
        dict(loss="ppo_clip", aggregation="seq_mean_token_mean"),
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize(("model", "rl"), MODES, ids=["ppo_token_kl", "gspo_seq_remat", "cispo_constant", "moe"])
def test_shared_packing_is_exactly_unshared_training(mesh: jax.sharding.Mesh, model: dict, rl: dict) -> None:
    _assert_same_training(_train(mesh, False, model, **rl), _train(mesh, True, model, **rl))


def test_shared_packing_through_blockwise_attention_is_exactly_unshared(mesh: jax.sharding.Mesh) -> None:
    # Rows of three 128-token tiles run blockwise attention ("auto" on CPU), whose tile skipping
    # reads the trie; four configurations make the tree two rows, one per micro-batch.
    assert resolve_kernel("auto", jax.numpy.float32, tiny_model().config.head_dim, 384) == "blockwise"
    run = partial(_train, mesh, model_overrides={"remat": "full"}, bucket=384, rows=1, configs=4, loss="ppo_clip")
    _assert_same_training(run(False), run(True))


def _assert_same_training(plain: dict, shared: dict) -> None:
    s_stats, p_stats = shared["packed"].stats, plain["packed"].stats
    assert any(mb.tree for mb in shared["packed"].micro_batches)
    assert len(shared["packed"].micro_batches) >= 2
    assert p_stats["batch/shared_token_frac"] == 0.0
    assert s_stats["batch/shared_token_frac"] > 0.3
    assert s_stats["batch/computed_tokens"] < p_stats["batch/computed_tokens"] == s_stats["batch/tokens"]

    keys = plain["logprobs"].keys()
    assert shared["logprobs"].keys() == keys and len(keys) == s_stats["batch/loss_tokens"]
    lp_err = max(abs(shared["logprobs"][k] - plain["logprobs"][k]) / abs(plain["logprobs"][k]) for k in keys)
    assert lp_err <= 1e-5
    assert shared["numerator"] == pytest.approx(plain["numerator"], rel=1e-5)
    assert shared["packed"].normaliser == plain["packed"].normaliser
    assert _rel(shared["grads"], plain["grads"]) <= 1e-5
    assert _rel(shared["params"], plain["params"]) <= 1e-5
    for key in ("loss", "grad_norm", "ratio_mean", "entropy", "tokens", "clip_frac_high", "mis_rejected_frac"):
        assert shared["metrics"][key] == pytest.approx(plain["metrics"][key], rel=1e-5, abs=1e-7), key
