"""Collecting episodes from a teacher: tasks × harness configurations run through
the rollout fleet (the same servers, sandboxes and verifiers as training), kept
by a filter and written as a rollouts directory that `legorl view` reads and
supervised fine-tuning takes in.

Token exactness: the proxy records the ids the engine sampled under the chat
template of the model directory it was started with, so the episodes are the
student's tokens only when teacher and student share that tokenizer. The
directory's `collect.json` says which tokenizer the ids are in. A chat teacher
(engine.kind openai_chat / anthropic) gives messages: they are recorded as the
student's template writes them (each sequence's `rerendered`, and the source's
`tokens`), without logprobs; such episodes are for fine-tuning, not RL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from legorl_jax.core.config import Config
from legorl_jax.core.seeds import derive_seed
from legorl_jax.fleet import Fleet
from legorl_jax.train.groups import HarnessChoice, group_spec
from legorl_jax.train.harness_metrics import PASS_THRESHOLD, passed
from legorl_jax.train.rollout_log import ROLLOUTS_FILE, RolloutLog, status_name
from protos.legorl.v1 import rollout_pb2 as pb

MANIFEST_FILE = "collect.json"
# What collect.json's source says of a chat teacher's episodes.
RERENDERED = "re-rendered with the student's template"
_ERRORS_LISTED = 10  # distinct causes of broken trials collect.json names
# The ends a rollout server has its verifier grade (the policy's own doing: done, out of time, out of budget).
GRADED = frozenset({pb.TRIAL_STATUS_OK, pb.TRIAL_STATUS_TIMEOUT, pb.TRIAL_STATUS_CAP_EXCEEDED})
GRADED_NAMES = frozenset(map(status_name, GRADED))  # as a rollouts directory writes them


def refuse_existing(out_dir: Path) -> None:
    """Nothing collected is ever written over: a directory that has episodes is refused."""
    if (Path(out_dir) / ROLLOUTS_FILE).exists():
        raise FileExistsError(f"{Path(out_dir) / ROLLOUTS_FILE} exists: collect into a new directory")


@dataclasses.dataclass(frozen=True)
class Keep:
    """Which episodes are written. Only graded ones (a reward, on an end in GRADED)
    are ever kept: an episode the engine, sandbox or harness broke teaches nothing."""

    passing_only: bool = False
    min_reward: float | None = None
    per_task: int | None = None  # at most this many per task, the best rewards first

    def __post_init__(self) -> None:
        if self.per_task is not None and self.per_task < 1:
            raise ValueError(f"the per-task cap must be at least 1, got {self.per_task}")

    def admits(self, trajectory: pb.Trajectory) -> bool:
        reward = trajectory.reward if trajectory.HasField("reward") else None
        return self.admits_outcome(status_name(trajectory.status), reward)

    def admits_outcome(self, status: str, reward: float | None) -> bool:
        """`admits` on a trajectory's outcome as `rollouts.jsonl` records it (status name, reward or None)."""
        if reward is None or status not in GRADED_NAMES:
            return False
        if self.passing_only and reward < PASS_THRESHOLD:
            return False
        return self.min_reward is None or reward >= self.min_reward

    def select(self, trajectories: Sequence[pb.Trajectory]) -> list[pb.Trajectory]:
        """The admitted episodes, capped per task (highest reward first, then run order)."""
        admitted = [t for t in trajectories if self.admits(t)]
        if self.per_task is None:
            return admitted
        by_task: dict[str, list[pb.Trajectory]] = defaultdict(list)
        for t in sorted(admitted, key=lambda t: -t.reward):  # stable: ties keep run order
            if len(by_task[t.task_id]) < self.per_task:
                by_task[t.task_id].append(t)
        kept = {id(t) for group in by_task.values() for t in group}
        return [t for t in admitted if id(t) in kept]


async def collect(
    fleet: Fleet,
    config: Config,
    task_ids: list[str],
    choices: list[HarnessChoice],
    *,
    samples: int,
    keep: Keep,
    out_dir: Path,
    tokenizer_dir: Path,
    source: dict[str, Any],
    progress: TextIO = sys.stderr,
) -> dict[str, Any]:
    """Runs `samples` trials of each task per harness configuration, writes the
    kept ones to `out_dir/rollouts.jsonl` (step 0, kind "collect") with the
    manifest beside them, and returns the manifest."""
    out_dir = Path(out_dir)
    refuse_existing(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = [
        group_spec(config, task, choice, samples, policy_version=0, step=0,
                   seed=derive_seed(config.seed, "collect", index, choice.config_id))
        for index, task in enumerate(task_ids)
        for choice in choices
    ]  # fmt: skip
    trajectories: list[pb.Trajectory] = []
    async for group in fleet.rollout(specs):
        trajectories.extend(group.trajectories)
        print(
            f"[collect] {len(trajectories)}/{len(specs) * samples} trials: "
            f"{group.trajectories[0].task_id if group.trajectories else '?'} "
            f"passed {sum(map(passed, group.trajectories))}/{len(group.trajectories)}",
            file=progress,
            flush=True,
        )
    kept = keep.select(trajectories)
    log = RolloutLog(out_dir, tokenizer_dir, resume_step=0)
    await asyncio.to_thread(log.write, 0, "collect", kept)
    statuses = Counter(status_name(t.status) for t in trajectories)
    # Why the ungraded trials broke (a refused key, an engine down): the most common causes, with their counts.
    errors = Counter(t.error for t in trajectories if t.status not in GRADED and t.error)
    manifest = {
        "source": source,
        "tokenizer": str(tokenizer_dir),
        "tasks": len(task_ids),
        "harness_configs": [c.config_id for c in choices],
        "samples": samples,
        "filter": dataclasses.asdict(keep),
        "trials": len(trajectories),
        "statuses": dict(sorted(statuses.items())),
        "errors": dict(errors.most_common(_ERRORS_LISTED)),
        "passed": sum(map(passed, trajectories)),
        "kept": len(kept),
    }
    (out_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
