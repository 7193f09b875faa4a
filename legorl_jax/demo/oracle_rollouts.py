"""The scripted oracle as a teacher: its verified episodes as a rollouts directory.

`SolutionOracle` (demonstrations.py) plays each task from its own
`solution/solve.sh` through the real lego harness and token-capture proxy, so
its episodes are token-exact in the student's tokenizer and graded by the
task's verifier. It knows the task's solution, which an engine behind
`legorl collect` never sees, so it cannot be served as one; this writes its
episodes in `legorl collect`'s format instead (`rollouts.jsonl` +
`collect.json`, status ok, the verifier's reward), which `legorl sft
--rollouts` and `legorl view` read like any collected directory.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from legorl_jax.demo.demonstrations import PLANS, Demonstration, plan_texts, record_demonstrations, solution_command
from legorl_jax.train.collect import MANIFEST_FILE, refuse_existing
from legorl_jax.train.harness_metrics import passed
from legorl_jax.train.rollout_log import RolloutLog
from protos.legorl.v1 import rollout_pb2 as pb
from rollout_server.harnesses.lego import LegoOptions, config_id
from rollout_server.tasks import Task

TEACHER = "scripted oracle (legorl_jax.demo.demonstrations.SolutionOracle: the task's solve.sh through lego)"
WORKING_PLANS = ("direct", "explore")


def trajectory(demo: Demonstration, moves: Sequence[str], index: int) -> pb.Trajectory:
    """One demonstration, whose model calls answered `moves`, as the fleet returns a graded
    trial (its sampled tokens carry no logprobs: 0)."""
    sequences = [pb.TokenSequence(token_ids=ids, loss_mask=mask, behavior_logprobs=[0.0] * len(ids))
                 for ids, mask in demo.sequences]  # fmt: skip
    tool_calls = sum("<tool_call>" in text for text in moves)
    return pb.Trajectory(
        request_id=f"oracle-{index}",
        task_id=demo.task,
        group_id=f"oracle-{demo.task}-{demo.config_id}",
        harness=pb.HarnessConfig(name="lego", config_id=demo.config_id),
        sequences=sequences,
        reward=demo.reward,
        status=pb.TRIAL_STATUS_OK,
        metrics=pb.TrialMetrics(model_calls=len(moves), tool_calls=tool_calls),
    )


def write_oracle_rollouts(
    demos: Sequence[Demonstration],
    moves: Sequence[Sequence[str]],
    out_dir: Path,
    tokenizer_dir: Path,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """Writes `demos` (with each one's completion texts, `moves`) as a new rollouts directory;
    returns its manifest (`collect.json`)."""
    out_dir = Path(out_dir)
    refuse_existing(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trajectories = [trajectory(d, m, i) for i, (d, m) in enumerate(zip(demos, moves, strict=True))]
    RolloutLog(out_dir, tokenizer_dir, resume_step=0).write(0, "collect", trajectories)
    manifest = {
        "source": {"teacher": TEACHER},
        "tokenizer": str(tokenizer_dir),
        "tasks": len({d.task for d in demos}),
        "harness_configs": sorted({d.config_id for d in demos}),
        "trials": len(trajectories),
        "statuses": {"ok": len(trajectories)},
        "passed": sum(map(passed, trajectories)),
        "kept": len(trajectories),
        **extra,
    }
    (out_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def record_oracle_rollouts(
    tokenizer_dir: Path,
    tasks: Sequence[Task],
    options: Sequence[LegoOptions],
    *,
    episodes: int,
    seed: int,
    out_dir: Path,
    max_context: int,
    max_tokens: int,
) -> dict[str, Any]:
    """`episodes` verified oracle episodes on a seeded draw of `tasks`, every configuration of
    `options` and both working plans per drawn task, as a rollouts directory. Episodes the
    verifier did not pass are dropped (demonstrations.py warns), so `kept` may fall short."""
    from transformers import AutoTokenizer  # deferred: seconds to import

    per_task = len(options) * len(WORKING_PLANS)
    drawn = random.Random(seed).sample(list(tasks), min(len(tasks), -(-episodes // per_task)))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    demos = record_demonstrations(
        tokenizer, drawn, options, plans=WORKING_PLANS, max_context=max_context, max_tokens=max_tokens
    )[:episodes]
    by_id = {config_id(o): o for o in options}
    by_name = {t.name: t for t in drawn}
    moves = [plan_texts(PLANS[d.plan], by_id[d.config_id], solution_command(by_name[d.task])) for d in demos]
    return write_oracle_rollouts(demos, moves, out_dir, tokenizer_dir, {"samples": 1, "seed": seed})
