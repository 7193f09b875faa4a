"""rollouts.jsonl: what the policy sampled, span by span, cut back on resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from legorl_jax.train.rollout_log import ROLLOUTS_FILE, RolloutLog, sampled_spans
from protos.legorl.v1 import rollout_pb2 as pb


def test_sampled_spans_are_the_runs_of_mask_ones() -> None:
    assert sampled_spans([1, 2, 3, 4, 5, 6], [0, 1, 1, 0, 1, 0]) == [[2, 3], [5]]
    assert sampled_spans([1, 2], [0, 0]) == []
    with pytest.raises(ValueError):
        sampled_spans([1, 2], [1])


def test_records_decode_sampled_text_and_resume_cuts_back(tokenizer_dir: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompt, answer = tokenizer.encode("list the files"), tokenizer.encode("ls -la")
    trajectory = pb.Trajectory(
        task_id="t1", harness=pb.HarnessConfig(name="lego", config_id="lego[x]"), reward=1.0,
        status=pb.TRIAL_STATUS_OK,
        sequences=[pb.TokenSequence(token_ids=prompt + answer, loss_mask=[0] * len(prompt) + [1] * len(answer))],
    )
    ungraded = pb.Trajectory(task_id="t2", status=pb.TRIAL_STATUS_ENV_FAILURE, error="image build failed")
    log = RolloutLog(tmp_path, tokenizer_dir, resume_step=0)
    log.write(1, "train", [trajectory, ungraded])
    log.write(2, "eval", [trajectory])
    lines = [json.loads(line) for line in (tmp_path / ROLLOUTS_FILE).read_text().splitlines()]
    assert lines[0] == {
        "step": 1, "kind": "train", "task": "t1", "harness": "lego[x]", "status": "ok", "reward": 1.0,
        "error": None, "sampled": ["ls -la"],
    }
    assert lines[1]["reward"] is None and lines[1]["status"] == "env_failure" and lines[1]["error"]
    RolloutLog(tmp_path, tokenizer_dir, resume_step=1)  # a resume from step 1 drops step 2's records
    assert [json.loads(x)["step"] for x in (tmp_path / ROLLOUTS_FILE).read_text().splitlines()] == [1, 1]
