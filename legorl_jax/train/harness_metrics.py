"""Rollout results per harness configuration, from what each trajectory carries.

Keys are `harness/<config id>/<name>`: pass rate and mean reward over graded
trials; env failures; and, per episode (a trial that did not end in an
environment failure, so an agent that never ran does not pull the means to
zero), model calls, tool calls, prompt and completion tokens, tool-call parse
errors, and the proxy's prefix merging: token sequences per trajectory, false
forks (main-conversation sequences restarted because the harness rewrote or
re-sent its history, each one a prompt trained apart) and side-call sequences.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from protos.legorl.v1 import rollout_pb2 as pb

PASS_THRESHOLD = 1.0 - 1e-6


def passed(trajectory: pb.Trajectory) -> bool:
    """Graded, with a full reward."""
    return trajectory.HasField("reward") and trajectory.reward >= PASS_THRESHOLD


# Root reasons of a sequence that should have merged into the one before it.
FALSE_FORK_REASONS = frozenset({"history_rewritten", "restart"})


def harness_id(trajectory: pb.Trajectory) -> str:
    """The harness configuration a trajectory ran under, as metrics name it."""
    return trajectory.harness.config_id or trajectory.harness.name


def _episode_means(episodes: list[pb.Trajectory]) -> dict[str, float]:
    """Means over episodes; none when every trial was an environment failure."""
    if not episodes:
        return {}

    def mean(values: Iterable[float]) -> float:
        return float(np.mean(list(values)))

    return {
        "model_calls_per_episode": mean(t.metrics.model_calls for t in episodes),
        "tool_calls_per_episode": mean(t.metrics.tool_calls for t in episodes),
        "tool_parse_errors_per_episode": mean(t.metrics.tool_parse_errors for t in episodes),
        "prompt_tokens_per_episode": mean(t.metrics.prompt_tokens for t in episodes),
        "completion_tokens_per_episode": mean(t.metrics.completion_tokens for t in episodes),
        "sequences_per_trajectory": mean(len(t.sequences) for t in episodes),
        "false_forks_per_trajectory": mean(
            sum(s.root_reason in FALSE_FORK_REASONS for s in t.sequences) for t in episodes
        ),
        "side_sequences_per_trajectory": mean(sum(s.side_call for s in t.sequences) for t in episodes),
    }


def harness_metrics(trajectories: Iterable[pb.Trajectory]) -> dict[str, float]:
    """`harness/<config id>/<name>` for every configuration among `trajectories`."""
    by_config: dict[str, list[pb.Trajectory]] = defaultdict(list)
    for t in trajectories:
        by_config[harness_id(t)].append(t)
    out: dict[str, float] = {}
    for config_id, group in sorted(by_config.items()):
        graded = [t.reward for t in group if t.HasField("reward")]
        failed = sum(t.status == pb.TRIAL_STATUS_ENV_FAILURE for t in group)
        values = {"trials": float(len(group)), "graded": float(len(graded)), "env_failures": float(failed)}
        if graded:
            values["pass_rate"] = float(np.mean([r >= PASS_THRESHOLD for r in graded]))
            values["reward_mean"] = float(np.mean(graded))
        values.update(_episode_means([t for t in group if t.status != pb.TRIAL_STATUS_ENV_FAILURE]))
        out.update({f"harness/{config_id}/{name}": value for name, value in values.items()})
    return out
