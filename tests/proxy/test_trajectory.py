"""Trajectory assembly rules on plain token lists."""

from __future__ import annotations

from typing import Any

from rollout_server.proxy.trajectory import CapturedTrajectory


def sample(
    traj: CapturedTrajectory,
    prompt: list[int],
    completion: list[int],
    root: str = "main",
    *,
    tools: bool = True,
    history: bool = True,
    version: int = 0,
) -> tuple[int, bool]:
    seq, merged = traj.place(prompt, root, has_tools=tools, has_history=history, policy_version=version)
    seq.extend_sampled(completion, [-0.5] * len(completion), None, version)
    return seq.index, merged


def reasons(traj: CapturedTrajectory) -> list[tuple[Any, Any]]:
    return [(s["root_reason"], s["side"]) for s in traj.to_json()["sequences"]]


def test_extension_merges_and_masks_only_sampled_tokens() -> None:
    traj = CapturedTrajectory()
    assert sample(traj, [1, 2], [3, 4], history=False) == (0, False)
    assert sample(traj, [1, 2, 3, 4, 5], [6], version=3) == (0, True)
    seq = traj.sequences[0]
    assert seq.token_ids == [1, 2, 3, 4, 5, 6]
    assert seq.loss_mask == [0, 0, 1, 1, 0, 1]
    assert seq.behavior_logprobs == [0.0, 0.0, -0.5, -0.5, 0.0, -0.5]
    assert seq.policy_version == 0  # the oldest weights that sampled into it


def test_prompt_that_drops_the_completion_is_not_an_extension() -> None:
    traj = CapturedTrajectory()
    sample(traj, [1, 2], [3], history=False)
    assert sample(traj, [1, 2, 9], [4]) == (1, False)
    assert sample(traj, [1, 2], [5], history=False) == (2, False)
    assert reasons(traj) == [("first_call", False), ("history_rewritten", False), ("restart", False)]


def test_side_calls_extend_their_own_sequence() -> None:
    traj = CapturedTrajectory()
    sample(traj, [1], [2], history=False)
    assert sample(traj, [7], [8], root="title", tools=False, history=False) == (1, False)
    assert sample(traj, [1, 2, 3], [4]) == (0, True)
    assert sample(traj, [7, 8, 9], [10], root="title", tools=False) == (1, True)
    assert reasons(traj) == [("first_call", False), ("side_call", True)]
    assert traj.total_tokens == 8
    metrics = traj.metrics()
    assert metrics["new_roots"] == {"first_call": 1, "side_call": 1}


def test_a_title_call_before_the_work_is_the_side_call() -> None:
    traj = CapturedTrajectory()
    sample(traj, [7], [8], root="title", tools=False, history=False)  # OpenCode asks for a title first
    sample(traj, [1], [2], history=False)
    assert reasons(traj) == [("side_call", True), ("first_call", False)]
