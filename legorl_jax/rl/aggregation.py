"""Loss aggregation: how masked per-token losses of a whole optimizer step become
one scalar.

Every mode is written as `Σ_tokens w_seq · loss_t / normaliser`, with a weight per
sequence and one normaliser for the step. The weights travel with the packed
tokens; the normaliser is known on the host before the first micro-batch, so
accumulating numerators across micro-batches and dividing once is exact.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from legorl_jax.core.registry import Registry

# (loss tokens per sequence, constant) -> (per-token weight of each sequence, normaliser)
Aggregation = Callable[[np.ndarray, float], tuple[np.ndarray, float]]
AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation")


@AGGREGATIONS.register("token_mean")
def token_mean(loss_tokens: np.ndarray, constant: float) -> tuple[np.ndarray, float]:
    """DAPO: every sampled token of the step counts the same."""
    return np.ones_like(loss_tokens, dtype=np.float64), float(loss_tokens.sum())


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(loss_tokens: np.ndarray, constant: float) -> tuple[np.ndarray, float]:
    """GRPO as published: mean over each sequence's tokens, then over sequences."""
    return 1.0 / np.maximum(loss_tokens, 1), float(loss_tokens.size)


@AGGREGATIONS.register("constant")
def constant(loss_tokens: np.ndarray, constant: float) -> tuple[np.ndarray, float]:
    """Dr. GRPO: a fixed per-sequence normaliser (the longest row) instead of |o_i|,
    removing the length bias; then mean over sequences."""
    return np.ones_like(loss_tokens, dtype=np.float64), float(loss_tokens.size) * constant


def aggregation_weights(mode: str, loss_tokens: np.ndarray, constant: float) -> tuple[np.ndarray, float]:
    if loss_tokens.size == 0:
        raise ValueError("cannot aggregate a step with no sequences")
    return AGGREGATIONS.get(mode)(np.asarray(loss_tokens), constant)
