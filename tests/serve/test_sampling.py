"""Sampling math on small explicit distributions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from legorl_jax.serve import sampling

# Jitted once per shape, as the engine runs them; eager calls re-trace every time.
processed_logprobs = jax.jit(sampling.processed_logprobs)
sample = jax.jit(sampling.sample)
target_logprobs = jax.jit(sampling.target_logprobs, static_argnums=3)

LOGITS = jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.1]], jnp.float32))


def _one(value: float | int, dtype: jnp.dtype) -> jax.Array:
    return jnp.array([value], dtype)


def test_unfiltered_processed_logprobs_are_tempered_log_softmax() -> None:
    for temperature in (1.0, 0.5, 2.0):
        got = processed_logprobs(LOGITS, _one(temperature, jnp.float32), _one(-1, jnp.int32), _one(1.0, jnp.float32))
        np.testing.assert_allclose(got, jax.nn.log_softmax(LOGITS / temperature), atol=1e-6)


def test_top_k_keeps_k_most_likely_and_renormalises() -> None:
    got = np.exp(processed_logprobs(LOGITS, _one(1.0, jnp.float32), _one(2, jnp.int32), _one(1.0, jnp.float32)))
    np.testing.assert_allclose(got, [[2 / 3, 1 / 3, 0, 0]], atol=1e-6)


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.5, [1, 0, 0, 0]),
        (0.6, [2 / 3, 1 / 3, 0, 0]),
        (0.75, [2 / 3, 1 / 3, 0, 0]),
        (0.8, [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0]),
    ],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p: float, expected: list[float]) -> None:
    got = np.exp(processed_logprobs(LOGITS, _one(1.0, jnp.float32), _one(-1, jnp.int32), _one(top_p, jnp.float32)))
    np.testing.assert_allclose(got, [expected], atol=1e-5)


def test_rows_filter_independently() -> None:
    logits = jnp.concatenate([LOGITS, LOGITS])
    got = np.exp(processed_logprobs(logits, jnp.ones(2), jnp.array([1, -1], jnp.int32), jnp.ones(2)))
    np.testing.assert_allclose(got[0], [1, 0, 0, 0], atol=1e-6)
    np.testing.assert_allclose(got[1], [0.5, 0.25, 0.15, 0.1], atol=1e-6)


def test_samples_follow_the_processed_distribution_and_report_its_logprob() -> None:
    n = 4000
    logits = jnp.tile(LOGITS, (n, 1))
    token, logprob, _ = sample(
        logits, jnp.full(n, 0.5), jnp.full(n, -1, jnp.int32), jnp.ones(n), jnp.full(n, 7, jnp.uint32), jnp.arange(n)
    )
    probs = np.asarray(jax.nn.softmax(LOGITS[0] / 0.5))
    freq = np.bincount(np.asarray(token), minlength=4) / n
    np.testing.assert_allclose(freq, probs, atol=0.03)
    np.testing.assert_allclose(np.exp(logprob), probs[np.asarray(token)], rtol=1e-5)


def test_sampling_depends_on_seed_and_counter_only() -> None:
    rows = 20
    logits = jnp.zeros((rows, 64))
    args = (jnp.ones(rows), jnp.full(rows, -1, jnp.int32), jnp.ones(rows))
    same_seed, _, _ = sample(logits, *args, jnp.ones(rows, jnp.uint32), jnp.arange(rows))
    again, _, _ = sample(logits, *args, jnp.ones(rows, jnp.uint32), jnp.arange(rows))
    other_seed, _, _ = sample(logits, *args, jnp.full(rows, 2, jnp.uint32), jnp.arange(rows))
    assert same_seed.tolist() == again.tolist()
    assert same_seed.tolist() != other_seed.tolist()
    assert len(set(same_seed.tolist())) > 5  # successive tokens of one request use fresh randomness


def test_first_argmax_is_argmax_on_ties_infinities_and_nan() -> None:
    nan, inf = float("nan"), float("inf")
    rows = [[1.0, 3.0, 3.0, 0.0], [-inf] * 4, [0.0, nan, 5.0, nan], [2.0] * 4, [-inf, 1.0, inf, inf]]
    random = np.random.default_rng(0).integers(0, 5, size=(50, 64)).astype(np.float32)  # many ties
    for x in (jnp.array(rows), jnp.asarray(random)):
        assert jax.jit(sampling.first_argmax)(x).tolist() == jnp.argmax(x, axis=-1).tolist()


def _reference_tokens(logits: jax.Array, temperature: np.ndarray, seeds: np.ndarray, counters: np.ndarray) -> list[int]:
    """Test instrument: the documented draw, row by row. A sampled row takes the
    argmax of its processed logprobs plus Gumbel noise keyed by fold_in(key(seed),
    counter); a greedy row the argmax alone."""
    top_k, top_p = jnp.full(len(temperature), -1, jnp.int32), jnp.ones(len(temperature))
    logprobs = processed_logprobs(logits, jnp.asarray(temperature), top_k, top_p)
    tokens = []
    for row, (t, seed, counter) in enumerate(zip(temperature, seeds, counters, strict=True)):
        scores = logprobs[row]
        if t > sampling.GREEDY_EPS:
            key = jax.random.fold_in(jax.random.key(seed), counter)
            scores = scores + jax.random.gumbel(key, logits.shape[-1:], jnp.float32)
        tokens.append(int(jnp.argmax(scores)))
    return tokens


@pytest.mark.parametrize("sampled_rows", [[], [2], [0, 1, 2, 3, 4, 5]])
def test_only_sampled_rows_draw_noise_and_each_from_its_own_key(sampled_rows: list[int]) -> None:
    rows, vocab = 6, 4096
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(rows, vocab)).astype(np.float32))
    temperature = np.zeros(rows, np.float32)
    temperature[sampled_rows] = 0.8
    seeds = rng.integers(0, 2**32, size=rows, dtype=np.uint32)
    counters = rng.integers(0, 1000, size=rows).astype(np.int32)
    token, logprob, logprobs = sample(
        logits, temperature, jnp.full(rows, -1, jnp.int32), jnp.ones(rows), seeds, counters
    )
    assert token.tolist() == _reference_tokens(logits, temperature, seeds, counters)
    chosen = np.take_along_axis(np.asarray(logprobs), np.asarray(token)[:, None], axis=-1)[:, 0]
    np.testing.assert_array_equal(logprob, chosen)


def test_greedy_at_zero_temperature_with_untempered_logprob() -> None:
    token, logprob, _ = sample(
        LOGITS,
        _one(0.0, jnp.float32),
        _one(-1, jnp.int32),
        _one(1.0, jnp.float32),
        _one(3, jnp.uint32),
        _one(0, jnp.int32),
    )
    assert int(token[0]) == 0
    np.testing.assert_allclose(float(logprob[0]), np.log(0.5), atol=1e-6)


def test_target_logprobs_and_rank() -> None:
    logits = LOGITS[:, None, :].repeat(3, axis=1)  # [1, 3, 4]
    lp, rank, top_lp, top_ids = target_logprobs(logits, jnp.array([[0, 2, -1]]), _one(1.0, jnp.float32), 2)
    np.testing.assert_allclose(lp[0, :2], np.log([0.5, 0.15]), atol=1e-6)
    assert rank[0, :2].tolist() == [1, 3]
    assert top_ids[0, 1].tolist() == [0, 1]
    np.testing.assert_allclose(top_lp[0, 1], np.log([0.5, 0.25]), atol=1e-6)
