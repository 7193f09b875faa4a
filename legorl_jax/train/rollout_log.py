"""`rollouts.jsonl`: every trajectory a run sampled, readable.

One JSON object per trajectory (step, kind, task, harness configuration,
status, reward, and the text of what the policy sampled, span by span), so a
curve that does not move can be explained by reading what the agent did. The
token ids themselves are in the checkpoints' inputs only transiently; this is
the record a person reads. Cut back to the restored step on resume, like the
metrics file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from legorl_jax.train.run_log import cut_back
from protos.legorl.v1 import rollout_pb2 as pb

ROLLOUTS_FILE = "rollouts.jsonl"


def sampled_spans(token_ids: list[int], loss_mask: list[int]) -> list[list[int]]:
    """The runs of consecutive sampled (mask 1) tokens."""
    spans: list[list[int]] = []
    inside = False
    for token, bit in zip(token_ids, loss_mask, strict=True):
        if bit and not inside:
            spans.append([])
        if bit:
            spans[-1].append(token)
        inside = bool(bit)
    return spans


class RolloutLog:
    def __init__(self, run_dir: Path, tokenizer_dir: Path, *, resume_step: int) -> None:
        from transformers import AutoTokenizer  # deferred: seconds to import

        self.path = Path(run_dir) / ROLLOUTS_FILE
        self._tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        cut_back(self.path, resume_step)

    def record(self, step: int, kind: str, trajectory: pb.Trajectory) -> dict[str, Any]:
        texts = [
            self._tokenizer.decode(span)
            for seq in trajectory.sequences
            for span in sampled_spans(list(seq.token_ids), list(seq.loss_mask))
        ]
        return {
            "step": step,
            "kind": kind,
            "task": trajectory.task_id,
            "harness": trajectory.harness.config_id or trajectory.harness.name,
            "status": pb.TrialStatus.Name(trajectory.status).removeprefix("TRIAL_STATUS_").lower(),
            "reward": trajectory.reward if trajectory.HasField("reward") else None,
            "error": trajectory.error or None,
            "sampled": texts,
        }

    def write(self, step: int, kind: str, trajectories: list[pb.Trajectory]) -> None:
        with self.path.open("a") as f:
            for trajectory in trajectories:
                f.write(json.dumps(self.record(step, kind, trajectory)) + "\n")
