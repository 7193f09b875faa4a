"""The supervised warm start on a tiny model, through `legorl sft`'s learner step: masking, exact
bucketed and prefix-shared packing, loss going down, the stopping rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from legorl_jax.core.config import LearnerConfig, MeshConfig, RLConfig
from legorl_jax.demo.demonstrations import Demonstration
from legorl_jax.demo.sft import (
    SFTConfig,
    SFTData,
    evaluate,
    pass_estimate,
    prepare,
    sample_groups,
    sft_buckets,
    step_sequences,
    train_sft,
)
from legorl_jax.demo.sft import _step_rows as step_rows
from legorl_jax.models import from_hf, token_logprobs
from legorl_jax.models.demo_assets import build_tiny_hf_model
from legorl_jax.rl.batching import PackedStep
from legorl_jax.train.sft import sft_rl
from legorl_jax.train.sharding import learner_mesh
from legorl_jax.train.step import Learner


@pytest.fixture(scope="module")
def tiny_dir(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hf_model(
        tmp_path_factory.mktemp("tiny"),
        hidden_size=32,
        num_layers=2,
        head_dim=8,
        intermediate_size=64,
        tokenizer_dir=tokenizer_dir,
    )


@pytest.fixture
def tiny_model(tiny_dir: Path) -> Any:
    return from_hf(tiny_dir)


# One compiled shape for every reference computation in this file.
row_logprobs = nnx.jit(lambda model, tokens: token_logprobs(model, tokens))


def short_demos() -> list[Demonstration]:
    """Two (task, config) groups; the first has two plans. Ids are arbitrary tokens below 256."""

    def seq(prompt: list[int], answer: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(prompt + answer), tuple([0] * len(prompt) + [1] * len(answer))

    return [
        Demonstration("a", "cfg", "direct", (seq([1, 2, 3], [10, 11, 12, 13]),)),
        Demonstration("a", "cfg", "explore", (seq([1, 2, 3], [20, 21]), seq([4, 5], [22]))),
        Demonstration("b", "cfg", "direct", (seq([7, 8, 9, 9], [30, 31, 32]),)),
    ]


def test_prepare_pads_rows_and_groups_plans() -> None:
    data = prepare(short_demos(), pad_id=0)
    assert data.tokens.shape == (4, 128) and data.mask.shape == (4, 128)
    assert data.lengths.tolist() == [7, 5, 3, 7]
    assert data.mask.sum() == 4 + 2 + 1 + 3
    assert data.episode.tolist() == [0, 1, 1, 2]
    assert data.groups == ((0, 1), (2,))
    assert data.config.tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="more than max_len=5"):
        prepare(short_demos(), pad_id=0, max_len=5)
    with pytest.raises(ValueError, match="no demonstration sequences"):
        prepare([], pad_id=0)


def padded_loss(model: Any, data: SFTData, rows: list[int]) -> Any:
    """The reference: every row padded to the longest, mean NLL over the assistant tokens."""
    tokens, mask = jnp.asarray(data.tokens[rows]), jnp.asarray(data.mask[rows, 1:])
    return -(token_logprobs(model, tokens) * mask).sum() / mask.sum()


def sft_learner(model: Any, buckets: list[int], budget: int, share_prefixes: bool) -> Learner:
    """`legorl sft`'s learner (what `train_sft` builds) with these buckets and token budget."""
    cfg = LearnerConfig(micro_batch_tokens=budget, length_buckets=buckets, share_prefixes=share_prefixes)
    return Learner(model, sft_rl(RLConfig()), cfg, learner_mesh(MeshConfig()))


def learner_loss_and_grads(learner: Learner, packed: PackedStep) -> tuple[float, Any]:
    """The step's loss and gradient before the update: the accumulated numerator over the normaliser."""
    grads, numerator, _ = learner.accumulate(packed)
    return float(numerator) / packed.normaliser, jax.tree.map(lambda g: g / packed.normaliser, grads)


def assert_matches_padded(model: Any, data: SFTData, rows: list[int], learner: Learner, packed: PackedStep) -> None:
    """Loss and every gradient of the learner's packed step equal the padded reference's (f32)."""
    loss, grads = learner_loss_and_grads(learner, packed)
    ref_loss, ref_grads = nnx.value_and_grad(padded_loss)(model, data, rows)
    assert loss == pytest.approx(float(ref_loss), rel=1e-5)
    # The reference's leaves are nnx Variables' values, named with a trailing ".value".
    want_by_path = {jax.tree_util.keystr(p).removesuffix(".value"): w for p, w in jax.tree.leaves_with_path(ref_grads)}
    got_by_path = {jax.tree_util.keystr(p): g for p, g in jax.tree.leaves_with_path(grads)}
    assert got_by_path.keys() == want_by_path.keys()
    for path, want in want_by_path.items():
        scale = float(jnp.abs(want).max())
        assert float(jnp.abs(got_by_path[path] - want).max()) <= 1e-5 * scale + 1e-9, path


def test_loss_counts_only_masked_tokens(tiny_model: Any) -> None:
    data = prepare(short_demos(), pad_id=0)
    one = np.zeros_like(data.mask[:1])
    one[0, 5] = 1.0  # only the prediction of token 5
    single = SFTData(data.tokens[:1], one, data.episode[:1], ((0,),), data.lengths[:1], data.config[:1])
    expected = -row_logprobs(tiny_model, jnp.asarray(data.tokens[:1]))[0, 4]
    learner = sft_learner(tiny_model, [8, 128], 128, share_prefixes=False)
    loss, _ = learner_loss_and_grads(learner, learner.pack(step_sequences(single, [0])))
    assert loss == pytest.approx(float(expected), rel=1e-5)


def long_prompt_demos(tails: int = 5) -> list[Demonstration]:
    """A CLI's episodes in miniature: one 150-token system prompt, then per task a short
    user turn and an answer of its own length. Task 0 has a second plan: the same user
    turn, another answer, so a branch starts at an answer token. Ids are arbitrary tokens below 256."""
    rng = np.random.default_rng(0)
    system = rng.integers(1, 256, 150).tolist()
    users = [rng.integers(1, 256, 3 + t).tolist() for t in range(tails - 1)]
    demos = []
    for t, user in enumerate([users[0], *users]):
        answer = rng.integers(1, 256, 4 + 7 * t).tolist()
        ids = system + user + answer
        mask = (0,) * (len(ids) - len(answer)) + (1,) * len(answer)
        task, plan = (f"task{max(t - 1, 0)}", "explore" if t == 0 else "direct")
        demos.append(Demonstration(task, "cfg", plan, ((tuple(ids), mask),)))
    return demos


def test_bucketed_packing_is_the_padded_loss(tiny_model: Any) -> None:
    """Rows padded to their bucket, several sequences to a row, split over micro-batches: same loss and gradients."""
    data = prepare([*short_demos(), *long_prompt_demos()], pad_id=0)
    assert sft_buckets(data.tokens.shape[1]) == [256]  # the longest (189 tokens) pads to 256
    rows = list(range(len(data.tokens)))
    learner = sft_learner(tiny_model, [16, 64, 256], 256, share_prefixes=False)
    packed = learner.pack(step_sequences(data, rows))
    # Short demonstrations fill the rows of long ones; a row per call, so several calls.
    assert len(packed.micro_batches) > 1 and max(mb.segment_ids.max() for mb in packed.micro_batches) > 1
    assert packed.stats["batch/shared_token_frac"] == 0
    # Short ones alone take a short bucket, not the longest demonstration's width.
    assert learner.pack(step_sequences(data, [0, 1, 2, 3])).micro_batches[0].tokens.shape == (1, 64)
    assert_matches_padded(tiny_model, data, rows, learner, packed)


def test_shared_prefix_packing_is_the_unshared_loss(tiny_model: Any) -> None:
    """The system prompt once per row as a trie: same loss and gradients, far fewer tokens computed."""
    data = prepare(long_prompt_demos(), pad_id=0)
    rows = [4, 0, 2, 1, 3]
    learner = sft_learner(tiny_model, [512], 512, share_prefixes=True)
    packed = learner.pack(step_sequences(data, rows))
    (mb,) = packed.micro_batches
    assert mb.tree and mb.tokens.shape == (1, 512)
    # The 150-token prompt once (not five times), task 0's 3-token user turn once (not twice).
    assert packed.stats["batch/computed_tokens"] == sum(data.lengths[rows]) - 4 * 150 - 3
    assert_matches_padded(tiny_model, data, rows, learner, packed)
    # A row too short for the whole trie splits it, each part with its own copy of the prompt.
    split = sft_learner(tiny_model, [256], 512, share_prefixes=True)
    packed = split.pack(step_sequences(data, rows))
    assert packed.micro_batches[0].tokens.shape == (2, 256)
    assert_matches_padded(tiny_model, data, rows, split, packed)


def test_training_lowers_the_loss_and_raises_the_pass_estimate(tiny_model: Any) -> None:
    """`train_sft` trains a copy: the given model is left as it was."""
    data = prepare(short_demos(), pad_id=0)
    before = evaluate(tiny_model, data)
    config = SFTConfig(max_steps=25, batch_size=4, learning_rate=1e-2, warmup_steps=2, eval_every=25, target_pass=1.0)
    trained, result = train_sft(tiny_model, data, config)
    after = evaluate(trained, data)
    assert result.steps == 25 and not result.reached_target
    assert after.loss < 0.5 * before.loss
    assert result.losses[-1] < result.losses[0]
    assert after.episode_pass_estimate > before.episode_pass_estimate
    assert after.token_accuracy > before.token_accuracy
    assert result.pass_estimates[-1] == (25, pytest.approx(after.episode_pass_estimate))
    assert evaluate(tiny_model, data) == before


def test_steps_by_configuration_cover_each_epoch() -> None:
    """With batch_by_config every step is one configuration's; an epoch is every trained row once."""
    demos = [Demonstration(f"t{i}", f"cli{i % 3}", "direct", (((1, 2, 3 + i, 4), (0, 0, 1, 1)),)) for i in range(10)]
    demos.append(Demonstration("t10", "cli0", "direct", (((1, 2), (0, 0)),)))  # nothing to train on
    data = prepare(demos, pad_id=0)
    steps = step_rows(data, SFTConfig(batch_size=2, batch_by_config=True, seed=3))
    # Configurations of 4, 3 and 3 rows: 2 + 2 + 2 steps an epoch.
    for _ in range(2):
        epoch = [next(steps) for _ in range(6)]
        assert all(len({int(data.config[r]) for r in rows}) == 1 for rows in epoch)
        assert sorted(r for rows in epoch for r in rows) == list(range(10))
    mixed = step_rows(data, SFTConfig(batch_size=2, seed=3))
    assert any(len({int(data.config[r]) for r in next(mixed)}) > 1 for _ in range(10))


def test_micro_batch_budget_must_hold_the_longest_row(tiny_model: Any) -> None:
    data = prepare(short_demos(), pad_id=0)
    with pytest.raises(ValueError, match="sft.micro_batch_tokens=64 holds no row"):
        train_sft(tiny_model, data, SFTConfig(max_steps=1, micro_batch_tokens=64))
    with pytest.raises(ValueError, match="sft.row_tokens=64 is shorter"):
        train_sft(tiny_model, data, SFTConfig(max_steps=1, row_tokens=64))


def test_buckets_pad_by_a_fifth_at_most() -> None:
    assert sft_buckets(1920) == [512, 640, 768, 896, 1024, 1280, 1536, 1792, 1920]
    ladder = sft_buckets(11264, 16384)
    assert ladder[-7:] == [7168, 8192, 10240, 11264, 12288, 14336, 16384]
    assert all(b / a <= 1.25 for a, b in zip(ladder, ladder[1:], strict=False))


def test_training_stops_at_the_target(tiny_model: Any) -> None:
    data = prepare(short_demos(), pad_id=0)
    config = SFTConfig(max_steps=50, batch_size=4, eval_every=3, target_pass=1e-300)
    seen: list[int] = []
    _, result = train_sft(tiny_model, data, config, on_step=lambda step, loss, estimate: seen.append(step))
    assert result.reached_target and result.steps == 3 and seen == [1, 2, 3]
    assert [step for step, _ in result.pass_estimates] == [3]


def test_pass_estimate_is_the_probability_of_reproducing_a_demonstration(tiny_model: Any) -> None:
    demos = short_demos()
    data = prepare(demos, pad_id=0)
    row_logp = [
        float((row_logprobs(tiny_model, jnp.asarray(data.tokens[r : r + 1]))[0] * data.mask[r, 1:]).sum())
        for r in range(4)
    ]
    # group a: plan direct (row 0) or plan explore (rows 1 and 2 together); group b: row 3.
    group_a = np.exp(row_logp[0]) + np.exp(row_logp[1] + row_logp[2])
    expected = (group_a + np.exp(row_logp[3])) / 2
    assert pass_estimate(tiny_model, data) == pytest.approx(expected, rel=1e-4)
    assert evaluate(tiny_model, data).episode_pass_estimate == pytest.approx(expected, rel=1e-4)


def test_failing_plans_and_sampled_groups_in_the_estimate(tiny_model: Any) -> None:
    demos = [*short_demos(), Demonstration("b", "cfg", "describe", (((7, 8, 9, 9, 40), (0, 0, 0, 0, 1)),), 0.0)]
    data = prepare(demos, pad_id=0)
    # The failing plan trains (its row is there) but is no way to pass: it is in no group.
    assert data.tokens.shape[0] == 5 and data.groups == ((0, 1), (2,))
    only_b = None
    for seed in range(10):
        sample = sample_groups(data, 1, seed=seed)
        assert len(sample.groups) == 1
        rows = sample.tokens.shape[0]
        # Group a owns two episodes in three rows; group b one episode in one row.
        assert (rows, sample.groups) in {(3, ((0, 1),)), (1, ((0,),))}
        if rows == 1:
            only_b = sample
    assert only_b is not None and np.array_equal(only_b.tokens[0], data.tokens[3])
    assert sample_groups(data, 5, seed=0) is data
