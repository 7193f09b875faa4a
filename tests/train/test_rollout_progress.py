"""The steps' bar counts a batch's groups as they end: a step's rollouts can take minutes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from legorl_jax.fleet import GroupResult, GroupSpec
from legorl_jax.train.loop import progress_bar, rolled_out
from protos.legorl.v1 import rollout_pb2 as pb


async def _ending(tasks: list[str]) -> AsyncIterator[GroupResult]:
    for task in tasks:
        spec = GroupSpec(pb.TaskRef(task_id=task), pb.HarnessConfig(name="lego"), 1, pb.SamplingParams(), 0)
        yield GroupResult(spec, task, [pb.Trajectory(task_id=task)])


def test_the_bar_counts_the_groups_of_each_round(capsys: pytest.CaptureFixture[str]) -> None:
    bar = progress_bar(16, 3, enabled=True)
    first = asyncio.run(rolled_out(_ending(["a", "b"]), bar, 0, 2))
    # A second round of dynamic sampling: one more group asked, two already in.
    second = asyncio.run(rolled_out(_ending(["c"]), bar, 2, 3))
    assert [g.group_id for g in first + second] == ["a", "b", "c"]
    drawn = capsys.readouterr().err
    for count in ("0/2", "1/2", "2/2", "2/3", "3/3"):
        assert f"train (rollouts: {count} groups)" in drawn
    assert "3/16" in drawn and "4/16" not in drawn  # the steps' count stays the steps'


def test_a_disabled_bar_draws_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    bar = progress_bar(16, 0, enabled=False)
    asyncio.run(rolled_out(_ending(["a"]), bar, 0, 1))
    assert capsys.readouterr().err == ""
