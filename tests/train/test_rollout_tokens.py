"""rollouts.jsonl's token records: the learner's logprobs written beside the
engine's, in sampled-token order, from a real update; and `logging.rollout_tokens`
choosing which sequences keep token records at all."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from tiny import VOCAB, learner_config, rl_config, sequence_logprobs, tiny_model

from legorl_jax.core.config import Config, MeshConfig
from legorl_jax.rl.batching import TrainSequence
from legorl_jax.train.rollout_log import ROLLOUTS_FILE, RolloutLog
from legorl_jax.train.sharding import learner_mesh
from legorl_jax.train.step import Learner
from protos.legorl.v1 import rollout_pb2 as pb


def _trajectory(rng: np.random.Generator, turns: int) -> pb.Trajectory:
    """A trajectory of one sequence: a prompt, then `turns` sampled turns with context between them."""
    ids, mask = list(rng.integers(0, VOCAB, 10)), [0] * 10
    for _ in range(turns):
        n = int(rng.integers(3, 7))
        ids += list(rng.integers(0, VOCAB, n)) + list(rng.integers(0, VOCAB, 3))
        mask += [1] * n + [0] * 3
    behaviour = [float(x) if bit else 0.0 for x, bit in zip(rng.uniform(-4, -0.1, len(ids)), mask, strict=True)]
    seq = pb.TokenSequence(token_ids=[int(i) for i in ids], loss_mask=mask, behavior_logprobs=behaviour)
    return pb.Trajectory(task_id="t", status=pb.TRIAL_STATUS_OK, reward=1.0, sequences=[seq])


def _trained(trajectory: pb.Trajectory, advantage: float) -> TrainSequence:
    [seq] = trajectory.sequences
    return TrainSequence(
        np.asarray(seq.token_ids, np.int32),
        np.asarray(seq.loss_mask, bool),
        np.asarray(seq.behavior_logprobs, np.float32),
        advantage,
    )


def _lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / ROLLOUTS_FILE).read_text().splitlines()]


@pytest.fixture(scope="module")
def step(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A real update on 3 of 4 trajectories (the second is left out, as an ungraded one would be)."""
    rng = np.random.default_rng(7)
    trajectories = [_trajectory(rng, turns) for turns in (1, 2, 1, 3)]
    trained = [_trained(t, a) for t, a in zip([trajectories[0], *trajectories[2:]], (0.5, -1.0, 0.25), strict=True)]
    learner = Learner(tiny_model(), rl_config(), learner_config(64), learner_mesh(MeshConfig()))
    expected = sequence_logprobs(learner.model(), [s.token_ids for s in trained])
    result = learner.update(learner.pack(trained))
    return {
        "trajectories": trajectories,
        "trained": trained,
        "expected": expected,
        "learner_logprobs": result.sequence_logprobs(),
        "micro_batches": len(result.packed.micro_batches),
    }


def test_learner_logprobs_are_written_beside_the_behaviour_ones(
    step: dict, tokenizer_dir: Path, tmp_path: Path
) -> None:
    assert step["micro_batches"] >= 2
    log = RolloutLog(tmp_path, tokenizer_dir, resume_step=0)
    log.write(1, "train", step["trajectories"], step["trained"], step["learner_logprobs"])
    lines = _lines(tmp_path)
    untrained = lines[1]["sequences"][0]
    assert untrained["advantage"] is None and untrained["learner_logprobs"] is None and untrained["pieces"]
    for line, seq, want in zip([lines[0], *lines[2:]], step["trained"], step["expected"], strict=True):
        [record] = line["sequences"]
        mask = np.asarray(seq.loss_mask)
        assert len(record["learner_logprobs"]) == len(record["logprobs"]) == int(mask.sum())
        # Rounded to 4 decimals in the file, like the behaviour logprobs.
        np.testing.assert_allclose(record["learner_logprobs"], want[mask], atol=5e-5 + 1e-5, rtol=0)
        np.testing.assert_allclose(record["logprobs"], seq.behavior_logprobs[mask], atol=5e-5 + 1e-7, rtol=0)


@pytest.mark.parametrize("tokens", ["all", "train", "none"])
def test_rollout_tokens_chooses_which_sequences_keep_token_records(
    step: dict, tokenizer_dir: Path, tmp_path: Path, tokens: str
) -> None:
    log = RolloutLog(tmp_path, tokenizer_dir, resume_step=0, tokens=tokens)
    assert log.wants_learner_logprobs() == (tokens != "none")
    log.write(1, "train", step["trajectories"], step["trained"], step["learner_logprobs"])
    log.write(1, "eval", step["trajectories"][:1])
    lines = _lines(tmp_path)
    has_tokens = [("pieces" in line["sequences"][0]) for line in lines]
    assert has_tokens == {"all": [True] * 5, "train": [True, False, True, True, False], "none": [False] * 5}[tokens]
    for line, trajectory in zip(lines, [*step["trajectories"], step["trajectories"][0]], strict=True):
        [record] = line["sequences"]
        # Every record keeps what the rollouts table and a curve need: spans, advantage, sampled text.
        mask = list(trajectory.sequences[0].loss_mask)
        assert sum(end - start for start, end in record["spans"]) == sum(mask)
        assert len(line["sampled"]) == len(record["spans"]) and "advantage" in record


def test_rollout_tokens_rejects_an_unknown_choice() -> None:
    with pytest.raises(ValidationError, match="rollout_tokens"):
        Config.model_validate({"logging": {"rollout_tokens": "some"}})
    assert Config().logging.rollout_tokens == "all"
