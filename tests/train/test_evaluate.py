"""Evaluation: pass rates per harness configuration, and a bar that counts the trials as they end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from legorl_jax.core.config import HarnessSpec, load_config
from legorl_jax.fleet import GroupResult, GroupSpec
from legorl_jax.train.evaluate import evaluate
from legorl_jax.train.groups import harness_choice
from protos.legorl.v1 import rollout_pb2 as pb


class _GradingFleet:
    """Stands in for the fleet (its rollouts are tested against real servers elsewhere): each trial
    ends graded, passing when its task id says so."""

    def __init__(self) -> None:
        self.specs: list[GroupSpec] = []

    async def rollout(self, specs: Sequence[GroupSpec]) -> AsyncIterator[GroupResult]:
        for spec in specs:
            self.specs.append(spec)
            trial = pb.Trajectory(harness=spec.harness, status=pb.TRIAL_STATUS_OK)
            trial.reward = 1.0 if spec.task.task_id.startswith("pass") else 0.0
            yield GroupResult(spec, spec.task.task_id, [trial])


@pytest.mark.parametrize("progress", [True, False])
def test_evaluation_reports_pass_rates_and_counts_its_trials_on_stderr(
    progress: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    config = load_config()
    choices = [harness_choice(HarnessSpec(name="lego", options={"tools": t})) for t in ("minimal", "full")]
    fleet = _GradingFleet()
    metrics = asyncio.run(
        evaluate(fleet, config, ["pass-a", "fail-b"], choices, policy_version=2, step=8, progress=progress)  # type: ignore[arg-type]
    )
    assert len(fleet.specs) == 4 and {s.group_size for s in fleet.specs} == {1}
    assert metrics["eval_pass_rate"] == 0.5
    assert {k: v for k, v in metrics.items() if k.startswith("eval_pass_rate/")} == {
        f"eval_pass_rate/{c.config_id}": 0.5 for c in choices
    }
    err = capsys.readouterr().err
    if progress:
        assert "eval @ step 8" in err and "4/4" in err and "passed=2" in err
    else:
        assert err == ""
