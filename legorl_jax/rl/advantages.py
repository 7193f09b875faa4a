"""Group-relative advantage estimators (host side, NumPy).

A group is the trials of one (task, harness config) pair. Rewards are floats, or
None for an ungraded trial (environment failure): such a trial carries no
evidence about the policy, so it gets no advantage and does not move its group's
baseline. A group whose graded rewards are all equal carries no contrast; it is
dropped and counted so the trainer can sample another (dynamic sampling).

Every estimator sees only the graded rewards of a group that has contrast and
returns one advantage per reward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from legorl_jax.core.registry import Registry

Estimator = Callable[[np.ndarray], np.ndarray]
ADVANTAGES: Registry[Estimator] = Registry("advantage estimator")
register_advantage = ADVANTAGES.register

# Population std of a group with contrast is at least this large for rewards in
# [0, 1]; the epsilon only guards against pathological float rewards.
STD_EPS = 1e-6


@register_advantage("grpo")
def grpo(rewards: np.ndarray) -> np.ndarray:
    """DeepSeekMath GRPO: (r - mean) / std, population std of the group."""
    return (rewards - rewards.mean()) / (rewards.std() + STD_EPS)


@register_advantage("dr_grpo")
def dr_grpo(rewards: np.ndarray) -> np.ndarray:
    """Dr. GRPO (Liu et al. 2025): mean-centred, no std division (removes difficulty bias)."""
    return rewards - rewards.mean()


@register_advantage("rloo")
def rloo(rewards: np.ndarray) -> np.ndarray:
    """REINFORCE leave-one-out: r_i minus the mean of the other members' rewards."""
    n = rewards.size
    return rewards - (rewards.sum() - rewards) / (n - 1)


@dataclass(frozen=True)
class GroupAdvantages:
    """Per-member advantages in input order; None marks a member left out of the loss."""

    advantages: list[list[float | None]]
    kept_groups: int
    dropped_zero_variance: int
    dropped_too_few_graded: int
    ungraded: int

    def metrics(self) -> dict[str, float]:
        return {
            "groups/kept": float(self.kept_groups),
            "groups/dropped_zero_variance": float(self.dropped_zero_variance),
            "groups/dropped_too_few_graded": float(self.dropped_too_few_graded),
            "trajectories/ungraded": float(self.ungraded),
        }


def compute_advantages(groups: Sequence[Sequence[float | None]], estimator: str = "grpo") -> GroupAdvantages:
    """Applies the named estimator to each group's graded rewards."""
    fn = ADVANTAGES.get(estimator)
    out: list[list[float | None]] = []
    kept = zero_var = too_few = ungraded = 0
    for g, group in enumerate(groups):
        graded_idx = [i for i, r in enumerate(group) if r is not None]
        ungraded += len(group) - len(graded_idx)
        advantages: list[float | None] = [None] * len(group)
        rewards = np.asarray([group[i] for i in graded_idx], dtype=np.float64)
        if not np.all(np.isfinite(rewards)):
            raise ValueError(f"group {g}: rewards must be finite or None, got {list(group)}")
        if rewards.size < 2:
            too_few += 1  # no baseline exists without a second graded member
        elif np.ptp(rewards) <= 1e-12 * max(1.0, float(np.abs(rewards).max())):
            zero_var += 1
        else:
            kept += 1
            for i, a in zip(graded_idx, fn(rewards), strict=True):
                advantages[i] = float(a)
        out.append(advantages)
    return GroupAdvantages(out, kept, zero_var, too_few, ungraded)
