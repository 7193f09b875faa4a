"""Advantage estimators against direct NumPy transcriptions of their formulas."""

from __future__ import annotations

import numpy as np
import pytest

from legorl_jax.core.registry import UnknownNameError
from legorl_jax.rl.advantages import ADVANTAGES, compute_advantages


def _reference(rewards: list[float], name: str) -> list[float]:
    r = np.array(rewards, dtype=np.float64)
    n = len(r)
    if name == "grpo":
        std = np.sqrt(((r - r.mean()) ** 2).sum() / n)
        return list((r - r.mean()) / (std + 1e-6))
    if name == "dr_grpo":
        return list(r - r.mean())
    # RLOO: baseline is the mean of the n-1 others
    return [r[i] - np.mean(np.delete(r, i)) for i in range(n)]


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_estimator_matches_reference_with_ungraded_and_flat_groups(name: str) -> None:
    rng = np.random.default_rng(0)
    groups: list[list[float | None]] = []
    for _ in range(40):
        g: list[float | None] = [float(x) for x in rng.choice([0.0, 0.5, 1.0], size=6)]
        for i in rng.choice(6, size=rng.integers(0, 3), replace=False):
            g[i] = None  # environment failure
        groups.append(g)
    groups.append([1.0, 1.0, None, 1.0])  # zero variance among graded
    groups.append([None, 0.3, None])  # a single graded member: no baseline
    res = compute_advantages(groups, name)

    flat = zero = few = ungraded = 0
    for group, adv in zip(groups, res.advantages, strict=True):
        graded = [r for r in group if r is not None]
        ungraded += len(group) - len(graded)
        if len(graded) < 2:
            few += 1
            assert adv == [None] * len(group)
            continue
        if len(set(graded)) == 1:
            zero += 1
            assert adv == [None] * len(group)
            continue
        flat += 1
        expected = iter(_reference(graded, name))
        for r, a in zip(group, adv, strict=True):
            if r is None:
                assert a is None
            else:
                assert a == pytest.approx(next(expected), abs=1e-9)
    assert (res.kept_groups, res.dropped_zero_variance, res.dropped_too_few_graded) == (flat, zero, few)
    assert res.ungraded == ungraded
    assert zero >= 1 and few >= 1
    assert res.metrics()["groups/dropped_zero_variance"] == zero


def test_ungraded_member_does_not_move_the_baseline() -> None:
    with_failure = compute_advantages([[1.0, 0.0, None, 0.0]], "dr_grpo").advantages[0]
    without = compute_advantages([[1.0, 0.0, 0.0]], "dr_grpo").advantages[0]
    assert with_failure[:2] + with_failure[3:] == pytest.approx(without)


def test_unknown_estimator_lists_the_valid_names() -> None:
    with pytest.raises(UnknownNameError, match="dr_grpo, grpo, rloo"):
        compute_advantages([[0.0, 1.0]], "ppo")
    assert set(ADVANTAGES.names()) >= {"grpo", "dr_grpo", "rloo"}


def test_non_finite_reward_is_rejected() -> None:
    with pytest.raises(ValueError, match="finite"):
        compute_advantages([[0.0, float("nan")]], "grpo")
