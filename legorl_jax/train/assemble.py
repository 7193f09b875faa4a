"""From rolled-out groups to the learner's sequences, and the step's rollout metrics.

Ungraded trajectories (reward absent: environment failures) leave both the
loss and their group's baseline; groups without reward contrast carry no
signal and are reported as dropped so the trainer samples more.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from legorl_jax.fleet import GroupResult
from legorl_jax.rl.advantages import compute_advantages
from legorl_jax.rl.batching import TrainSequence
from legorl_jax.train.harness_metrics import PASS_THRESHOLD, harness_metrics
from legorl_jax.train.token_versions import VersionStats
from protos.legorl.v1 import rollout_pb2 as pb


@dataclass
class Assembled:
    sequences: list[TrainSequence] = field(default_factory=list)
    informative_groups: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


def is_informative(group: GroupResult) -> bool:
    rewards = [t.reward for t in group.trajectories if t.HasField("reward")]
    return len(rewards) >= 2 and max(rewards) - min(rewards) > 1e-9


def rollout_metrics(groups: list[GroupResult]) -> dict[str, float]:
    """Reward, pass rates (overall and per harness configuration), statuses, and
    `harness_metrics` per configuration."""
    trajectories = [t for g in groups for t in g.trajectories]
    graded = [t for t in trajectories if t.HasField("reward")]
    out: dict[str, float] = {
        "rollout/trials": float(len(trajectories)),
        "rollout/graded": float(len(graded)),
        "rollout/env_failures": float(sum(t.status == pb.TRIAL_STATUS_ENV_FAILURE for t in trajectories)),
        # Graded 0 because the agent's output broke the tests: counted apart from env failures.
        "rollout/verifier_no_reward": float(sum(t.metrics.verifier_no_reward for t in trajectories)),
        "rollout/model_calls": float(sum(t.metrics.model_calls for t in trajectories)),
        "rollout/completion_tokens": float(sum(t.metrics.completion_tokens for t in trajectories)),
        "rollout/reissues": float(sum(g.reissues for g in groups)),
    }
    if graded:
        out["reward/mean"] = float(np.mean([t.reward for t in graded]))
        out["pass_rate"] = float(np.mean([t.reward >= PASS_THRESHOLD for t in graded]))
    by_config: dict[str, list[float]] = defaultdict(list)
    for t in graded:
        by_config[t.harness.config_id or t.harness.name].append(float(t.reward >= PASS_THRESHOLD))
    for config_id, passes in sorted(by_config.items()):
        out[f"pass_rate/{config_id}"] = float(np.mean(passes))
    for status, count in Counter(pb.TrialStatus.Name(t.status) for t in trajectories).items():
        out[f"status/{status.removeprefix('TRIAL_STATUS_').lower()}"] = float(count)
    out.update(harness_metrics(trajectories))
    return out


def refuse_rerendered(groups: list[GroupResult]) -> None:
    """RL trains on the policy's own samples: a chat teacher's re-rendered turns
    (engine.kind openai_chat / anthropic on a rollout server) have no behaviour
    logprobs, and their IS ratios would be made up. Refused, naming the server's setting."""
    for group in groups:
        for t in group.trajectories:
            if any(seq.rerendered for seq in t.sequences):
                raise ValueError(
                    f"a trajectory of task {t.task_id} holds a chat teacher's re-rendered turns (a rollout server "
                    "with engine.kind openai_chat or anthropic): RL trains only on the policy's own samples; "
                    "collect a teacher's episodes with `legorl collect` instead"
                )


def assemble(
    groups: list[GroupResult], estimator: str, *, min_policy_version: int = 0, include_side_calls: bool = False
) -> Assembled:
    """Advantages per group, then one TrainSequence per trainable token sequence.
    The lag bound applies per token: a token sampled by a policy older than
    `min_policy_version` leaves the loss (masked), a sequence with none left is
    dropped, and a trajectory with none left leaves its group's baseline too."""
    refuse_rerendered(groups)
    stats = VersionStats()
    stale = 0
    rewards: list[list[float | None]] = []
    versions: list[list[list[np.ndarray | None]]] = []  # per group, trajectory, sequence
    for group in groups:
        row: list[float | None] = []
        group_versions: list[list[np.ndarray | None]] = []
        for t in group.trajectories:
            seq_versions, all_stale = stats.read(t, min_policy_version, include_side_calls)
            if all_stale:
                stale += 1  # every token sampled by a policy older than the lag bound allows
                row.append(None)
            else:
                row.append(t.reward if t.HasField("reward") else None)
            group_versions.append(seq_versions)
        rewards.append(row)
        versions.append(group_versions)
    advantages = compute_advantages(rewards, estimator)

    out = Assembled(informative_groups=advantages.kept_groups)
    skipped_sequences = stale_sequences = 0
    for group, group_adv, group_versions in zip(groups, advantages.advantages, versions, strict=True):
        for trajectory, advantage, seq_versions in zip(group.trajectories, group_adv, group_versions, strict=True):
            if advantage is None:
                continue
            for seq, seq_v in zip(trajectory.sequences, seq_versions, strict=True):
                if (
                    (seq.side_call and not include_side_calls)
                    or len(seq.token_ids) < 2
                    or not any(seq.loss_mask)
                    or seq_v is None
                ):
                    skipped_sequences += 1
                    continue
                fresh = np.asarray(seq.loss_mask, bool) & (seq_v >= min_policy_version)
                if not fresh.any():
                    stale_sequences += 1
                    continue
                stats.add_trained(seq_v)
                out.sequences.append(
                    TrainSequence(
                        token_ids=np.asarray(seq.token_ids, np.int32),
                        loss_mask=fresh,
                        # Per token, from the engine step that sampled it: the IS ratios use them as they are.
                        behavior_logprobs=np.asarray(seq.behavior_logprobs, np.float32),
                        advantage=float(advantage),
                        policy_version=int(seq_v[fresh].min()),
                        token_versions=np.where(fresh, seq_v, -1),
                    )
                )
    out.metrics = {
        **rollout_metrics(groups),
        **advantages.metrics(),
        **stats.metrics(),
        "trajectories/stale": float(stale),
        "sequences/trained": float(len(out.sequences)),
        "sequences/skipped": float(skipped_sequences),
        "sequences/stale": float(stale_sequences),
    }
    return out
