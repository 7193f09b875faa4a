"""The lag bound per token: tokens sampled by a policy older than the bound
leave the loss, sequences with none left leave the batch, trajectories with
none left leave their group's baseline; and the step's version metrics."""

from __future__ import annotations

import numpy as np
import pytest

from legorl_jax.fleet import GroupResult, GroupSpec
from legorl_jax.train.assemble import assemble
from protos.legorl.v1 import rollout_pb2 as pb

# Two completions of 3 sampled tokens each, after a 2-token prompt and a 1-token tool result.
TOKENS = [5, 6, 7, 8, 9, 10, 11, 12, 13]
MASK = [0, 0, 1, 1, 1, 0, 1, 1, 1]
LOGPROBS = [0.0, 0.0, -0.1, -0.2, -0.3, 0.0, -0.4, -0.5, -0.6]


def sequence(runs: list[tuple[int, int]], *, policy_version: int | None = None, side: bool = False) -> pb.TokenSequence:
    return pb.TokenSequence(
        token_ids=TOKENS,
        loss_mask=MASK,
        behavior_logprobs=LOGPROBS,
        policy_version=min(v for v, _ in runs) if policy_version is None else policy_version,
        side_call=side,
        version_runs=[v for v, _ in runs],
        version_run_lengths=[n for _, n in runs],
    )


def trajectory(reward: float, *sequences: pb.TokenSequence) -> pb.Trajectory:
    return pb.Trajectory(status=pb.TRIAL_STATUS_OK, reward=reward, sequences=list(sequences))


def group(*trajectories: pb.Trajectory) -> GroupResult:
    spec = GroupSpec(pb.TaskRef(task_id="t"), pb.HarnessConfig(name="lego"), len(trajectories), pb.SamplingParams(), 5)
    return GroupResult(spec, "g", list(trajectories))


def test_tokens_older_than_the_bound_are_masked_per_token() -> None:
    # An update landed after the first completion's second token: versions 4, 4, 5 | 5, 5, 5.
    split = sequence([(4, 2), (5, 4)])
    out = assemble([group(trajectory(1.0, split), trajectory(0.0, sequence([(5, 6)])))], "grpo", min_policy_version=5)
    first = out.sequences[0]
    np.testing.assert_array_equal(first.loss_mask, [0, 0, 0, 0, 1, 0, 1, 1, 1])
    np.testing.assert_array_equal(first.token_versions, [-1, -1, -1, -1, 5, -1, 5, 5, 5])
    assert first.policy_version == 5
    np.testing.assert_array_equal(out.sequences[1].loss_mask, np.asarray(MASK, bool))
    assert out.metrics["rollout/stale_tokens_dropped"] == 2
    assert out.metrics["rollout/mixed_version_frac"] == pytest.approx(0.5)
    assert out.metrics["rollout/version_span_max"] == 1
    # Without a bound every token trains, each with its own version.
    kept = assemble([group(trajectory(1.0, split), trajectory(0.0, sequence([(5, 6)])))], "grpo")
    np.testing.assert_array_equal(kept.sequences[0].token_versions, [-1, -1, 4, 4, 5, -1, 5, 5, 5])
    assert kept.metrics["rollout/stale_tokens_dropped"] == 0


def test_a_sequence_with_nothing_fresh_is_dropped_and_a_trajectory_with_nothing_fresh_is_stale() -> None:
    mixed = trajectory(1.0, sequence([(3, 6)]), sequence([(5, 6)]))  # one stale sequence, one fresh
    out = assemble([group(mixed, trajectory(0.0, sequence([(5, 6)])))], "grpo", min_policy_version=5)
    assert len(out.sequences) == 2 and out.metrics["sequences/stale"] == 1
    assert out.metrics["trajectories/stale"] == 0
    # Every token stale: out of the baseline, so the group has one graded member and no contrast.
    stale = assemble(
        [group(trajectory(1.0, sequence([(3, 6)])), trajectory(0.0, sequence([(5, 6)])))], "grpo", min_policy_version=5
    )
    assert stale.sequences == [] and stale.metrics["trajectories/stale"] == 1
    assert stale.metrics["rollout/stale_tokens_dropped"] == 6


def test_a_sequence_without_runs_is_all_its_policy_version() -> None:
    old_server = pb.TokenSequence(token_ids=TOKENS, loss_mask=MASK, behavior_logprobs=LOGPROBS, policy_version=4)
    out = assemble([group(trajectory(1.0, old_server), trajectory(0.0, old_server))], "grpo", min_policy_version=4)
    np.testing.assert_array_equal(out.sequences[0].token_versions, np.where(np.asarray(MASK, bool), 4, -1))
    assert out.metrics["rollout/mixed_version_frac"] == 0.0


def test_runs_that_do_not_cover_the_sampled_tokens_leave_the_sequence_out() -> None:
    short = sequence([(5, 2)])  # 2 of 6 sampled tokens
    out = assemble([group(trajectory(1.0, short), trajectory(0.0, sequence([(5, 6)])))], "grpo")
    assert len(out.sequences) == 1 and out.metrics["sequences/bad_version_runs"] == 1
