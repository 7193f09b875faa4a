"""rollouts.jsonl: what the policy sampled, span by span and token by token, cut back on resume."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from legorl_jax.train.rollout_log import (
    ROLLOUTS_FILE,
    RolloutLog,
    sampled_spans,
    span_bounds,
    token_pieces,
    trained_advantages,
)
from protos.legorl.v1 import rollout_pb2 as pb


def test_sampled_spans_are_the_runs_of_mask_ones() -> None:
    assert sampled_spans([1, 2, 3, 4, 5, 6], [0, 1, 1, 0, 1, 0]) == [[2, 3], [5]]
    assert sampled_spans([1, 2], [0, 0]) == []
    with pytest.raises(ValueError):
        sampled_spans([1, 2], [1])
    assert span_bounds([0, 1, 1, 0, 1, 0]) == [[1, 3], [4, 5]]
    assert span_bounds([1, 1]) == [[0, 2]] and span_bounds([0, 0]) == []


def test_token_pieces_join_to_the_text_and_never_split_a_character(tokenizer) -> None:
    text = "naïve café → 東京 ok"
    ids = tokenizer.encode(text)
    cache: dict[int, str] = {}
    for _ in range(2):  # the second time from the cache
        pieces = token_pieces(tokenizer.decode, ids, cache)
        assert len(pieces) == len(ids)
        assert "".join(pieces) == tokenizer.decode(ids)
        assert not any("\ufffd" in piece for piece in pieces)
    assert any(piece == "" for piece in pieces)  # a character split over tokens went to its last one


def test_a_token_ending_one_character_and_starting_the_next_keeps_the_first() -> None:
    # Byte-level tokens as a trained BPE can merge them: one ends "日" and begins "本".
    ni, hon = "日".encode(), "本".encode()
    vocab = {1: b"ok", 2: b" " + ni + hon[:1], 3: hon[1:], 4: b"<end>", 5: ni[:2]}

    def decode(ids: list[int]) -> str:
        return b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")

    ids, mask = [1, 2, 3, 4], [1, 1, 0, 0]  # the span ends inside "本"
    pieces = token_pieces(decode, ids, {})
    assert pieces == ["ok", " 日", "本", "<end>"]
    # The span's pieces hold every character it finishes: its own decode less the unfinished one.
    ((start, end),) = span_bounds(mask)
    assert "".join(pieces[start:end]) == decode(ids[start:end]).rstrip("\ufffd")
    # A run cut off at the end of the sequence shares out the same way; its unfinished bytes stay marked.
    assert token_pieces(decode, [1, 2, 5], {}) == ["ok", " 日", "\ufffd\ufffd"]


def test_trained_advantages_pair_learner_sequences_with_their_trajectories() -> None:
    def traj(*seqs: list[int]) -> pb.Trajectory:
        return pb.Trajectory(sequences=[pb.TokenSequence(token_ids=s) for s in seqs])

    trajectories = [traj([1, 2], [1, 2, 3]), traj([4, 5]), traj([6, 7], [8])]
    # the second trajectory was left out (ungraded), the last one's short sequence skipped
    pairs = [([1, 2], 0.5), ([1, 2, 3], 0.5), ([6, 7], -1.0)]
    trained = [SimpleNamespace(token_ids=ids, advantage=a) for ids, a in pairs]
    assert trained_advantages(trajectories, trained) == [[0.5, 0.5], [None], [-1.0, None]]
    assert trained_advantages(trajectories, []) == [[None, None], [None], [None, None]]


def test_records_decode_sampled_text_and_resume_cuts_back(tokenizer_dir: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompt, answer = tokenizer.encode("list the files"), tokenizer.encode("ls -la")
    ids = prompt + answer
    trajectory = pb.Trajectory(
        task_id="t1",
        harness=pb.HarnessConfig(name="lego", config_id="lego[x]"),
        reward=1.0,
        status=pb.TRIAL_STATUS_OK,
        group_id="g1",
        trial_index=1,
        metrics=pb.TrialMetrics(model_calls=1, tool_calls=1),
        sequences=[
            pb.TokenSequence(
                token_ids=ids,
                loss_mask=[0] * len(prompt) + [1] * len(answer),
                behavior_logprobs=[0.0] * len(prompt) + [-0.123456] * len(answer),
                policy_version=3,
                num_model_calls=1,
                root_reason="history_rewritten",
                recomputed_tokens=2,
                # An update landed mid-completion: the first sampled token is version 2's.
                version_runs=[2, 3],
                version_run_lengths=[1, len(answer) - 1],
            )
        ],
    )
    ungraded = pb.Trajectory(task_id="t2", status=pb.TRIAL_STATUS_ENV_FAILURE, error="image build failed")
    log = RolloutLog(tmp_path, tokenizer_dir, resume_step=0)
    log.write(1, "train", [trajectory, ungraded], trained=[SimpleNamespace(token_ids=ids, advantage=0.75)])
    log.write(2, "eval", [trajectory])
    lines = [json.loads(line) for line in (tmp_path / ROLLOUTS_FILE).read_text().splitlines()]
    first = lines[0]
    keys = ("step", "kind", "task", "harness", "group", "trial", "status", "reward", "error")
    assert {k: first[k] for k in keys} == {
        "step": 1,
        "kind": "train",
        "task": "t1",
        "harness": "lego[x]",
        "group": "g1",
        "trial": 1,
        "status": "ok",
        "reward": 1.0,
        "error": None,
    }
    assert first["sampled"] == ["ls -la"]
    assert first["metrics"]["model_calls"] == 1 and first["metrics"]["verifier_no_reward"] is False
    [seq] = first["sequences"]
    assert seq["ids"] == ids and seq["spans"] == [[len(prompt), len(ids)]]
    assert "".join(seq["pieces"][len(prompt) :]) == "ls -la"
    assert seq["logprobs"] == [-0.1235] * len(answer)  # sampled tokens only, rounded
    assert seq["advantage"] == 0.75 and seq["policy_version"] == 3 and seq["model_calls"] == 1
    assert (seq["root_reason"], seq["recomputed_tokens"]) == ("history_rewritten", 2)
    assert seq["versions"] == [[2, 1], [3, len(answer) - 1]] and seq["unreported_version_tokens"] == 0
    assert lines[1]["reward"] is None and lines[1]["status"] == "env_failure" and lines[1]["error"]
    assert lines[1]["sequences"] == []
    assert lines[2]["sequences"][0]["advantage"] is None  # evaluations are not trained
    RolloutLog(tmp_path, tokenizer_dir, resume_step=1)  # a resume from step 1 drops step 2's records
    assert [json.loads(x)["step"] for x in (tmp_path / ROLLOUTS_FILE).read_text().splitlines()] == [1, 1]
