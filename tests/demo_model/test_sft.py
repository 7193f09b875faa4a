"""The supervised warm start on a tiny model: masking, loss going down, the stopping rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from legorl_jax.demo.demonstrations import Demonstration
from legorl_jax.demo.sft import (
    SFTConfig,
    evaluate,
    pass_estimate,
    prepare,
    sample_groups,
    sft_loss,
    train_sft,
)
from legorl_jax.models import from_hf, token_logprobs
from legorl_jax.models.demo_assets import build_tiny_hf_model


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
    assert data.mask.sum() == 4 + 2 + 1 + 3
    assert data.episode.tolist() == [0, 1, 1, 2]
    assert data.groups == ((0, 1), (2,))
    with pytest.raises(ValueError, match="more than max_len=5"):
        prepare(short_demos(), pad_id=0, max_len=5)
    with pytest.raises(ValueError, match="no demonstration sequences"):
        prepare([], pad_id=0)


def test_loss_counts_only_masked_tokens(tiny_model: Any) -> None:
    data = prepare(short_demos(), pad_id=0)
    tokens = jnp.asarray(data.tokens[:1])
    one = np.zeros_like(data.mask[:1])
    one[0, 5] = 1.0  # only the prediction of token 5
    expected = -row_logprobs(tiny_model, tokens)[0, 4]
    assert float(sft_loss(tiny_model, tokens, jnp.asarray(one))) == pytest.approx(float(expected), rel=1e-5)


def test_training_lowers_the_loss_and_raises_the_pass_estimate(tiny_model: Any) -> None:
    data = prepare(short_demos(), pad_id=0)
    before = evaluate(tiny_model, data)
    config = SFTConfig(max_steps=25, batch_size=4, learning_rate=1e-2, warmup_steps=2, eval_every=25, target_pass=1.0)
    result = train_sft(tiny_model, data, config)
    after = evaluate(tiny_model, data)
    assert result.steps == 25 and not result.reached_target
    assert after.loss < 0.5 * before.loss
    assert result.losses[-1] < result.losses[0]
    assert after.episode_pass_estimate > before.episode_pass_estimate
    assert after.token_accuracy > before.token_accuracy
    assert result.pass_estimates[-1] == (25, pytest.approx(after.episode_pass_estimate))


def test_training_stops_at_the_target(tiny_model: Any) -> None:
    data = prepare(short_demos(), pad_id=0)
    config = SFTConfig(max_steps=50, batch_size=4, eval_every=3, target_pass=1e-300)
    seen: list[int] = []
    result = train_sft(tiny_model, data, config, on_step=lambda step, loss, estimate: seen.append(step))
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
