"""Group sampling and trajectory assembly: the trainer's host-side bookkeeping."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from legorl_jax.core.config import HarnessSpec
from legorl_jax.fleet import GroupResult, GroupSpec
from legorl_jax.train.assemble import assemble, is_informative, rollout_metrics
from legorl_jax.train.groups import GroupSampler, harness_choice
from legorl_jax.train.run_log import RunLog, read_metrics
from protos.legorl.v1 import rollout_pb2 as pb

MIX = [
    HarnessSpec(name="lego", options={"tools": "bash_only"}),
    HarnessSpec(name="lego", options={"tools": "minimal"}, weight=3),
]


def test_every_task_once_per_epoch_and_cursor_resumes() -> None:
    sampler = GroupSampler(["a", "b", "c"], MIX, seed=1)
    first_epoch = [sampler.next()[0] for _ in range(3)]
    assert sorted(first_epoch) == ["a", "b", "c"]
    sampler.next()
    cursor = sampler.cursor
    expected = [sampler.next() for _ in range(5)]
    resumed = GroupSampler(["c", "b", "a"], MIX, seed=1)
    resumed.restore(cursor)
    assert [resumed.next() for _ in range(5)] == expected


def test_harness_weights_and_readable_ids() -> None:
    sampler = GroupSampler([f"t{i}" for i in range(400)], MIX, seed=0)
    ids = [sampler.next()[1].config_id for _ in range(400)]
    assert ids.count("lego[tools=minimal]") > 2 * ids.count("lego[tools=bash_only]")
    assert harness_choice(HarnessSpec(name="codex")).config_id == "codex"


def test_equal_weights_give_every_harness_its_share_in_a_short_run() -> None:
    clis = [HarnessSpec(name=name) for name in ("a", "b", "c", "d", "e", "f", "g")]
    sampler = GroupSampler([f"t{i}" for i in range(10)], clis, seed=3)
    counts = Counter(sampler.next()[1].name for _ in range(7 * 9 + 3))
    assert set(counts) == set("abcdefg")
    assert max(counts.values()) - min(counts.values()) <= 1
    weighted = GroupSampler([f"t{i}" for i in range(5)], MIX, seed=2)
    ids = Counter(weighted.next()[1].config_id for _ in range(400))
    assert ids["lego[tools=minimal]"] == pytest.approx(300, abs=40)


def test_no_tasks_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no training tasks"):
        GroupSampler([], MIX, seed=0)


def trajectory(reward: float | None, config_id: str = "c", version: int = 3, side: bool = False) -> pb.Trajectory:
    t = pb.Trajectory(
        harness=pb.HarnessConfig(name="lego", config_id=config_id),
        status=pb.TRIAL_STATUS_OK if reward is not None else pb.TRIAL_STATUS_ENV_FAILURE,
        sequences=[
            pb.TokenSequence(
                token_ids=[5, 6, 7, 8],
                loss_mask=[0, 0, 1, 1],
                behavior_logprobs=[0, 0, -0.5, -1.0],
                policy_version=version,
                side_call=side,
            )
        ],
    )
    if reward is not None:
        t.reward = reward
    t.metrics.completion_tokens = 2
    return t


def group(*trajectories: pb.Trajectory) -> GroupResult:
    spec = GroupSpec(pb.TaskRef(task_id="t"), pb.HarnessConfig(name="lego"), len(trajectories), pb.SamplingParams(), 3)
    return GroupResult(spec, "g", list(trajectories))


def test_assemble_drops_ungraded_zero_variance_and_stale() -> None:
    groups = [
        group(trajectory(1.0), trajectory(0.0), trajectory(None)),  # informative; one env failure
        group(trajectory(0.0), trajectory(0.0)),  # no contrast
        group(trajectory(1.0, version=0), trajectory(0.0)),  # stale member leaves too few graded
    ]
    assert [is_informative(g) for g in groups] == [True, False, True]
    out = assemble(groups, "grpo", min_policy_version=2)
    assert out.informative_groups == 1
    assert [s.advantage for s in out.sequences] == pytest.approx([1.0, -1.0], rel=1e-4)  # (r - mean) / std over {1, 0}
    np.testing.assert_array_equal(out.sequences[0].loss_mask, [False, False, True, True])
    assert out.metrics["groups/dropped_zero_variance"] == 1
    assert out.metrics["trajectories/stale"] == 1
    assert out.metrics["rollout/env_failures"] == 1
    assert out.metrics["trajectories/ungraded"] == 2


def test_side_calls_are_excluded_unless_asked() -> None:
    groups = [group(trajectory(1.0, side=True), trajectory(0.0))]
    assert len(assemble(groups, "grpo").sequences) == 1
    assert len(assemble(groups, "grpo", include_side_calls=True).sequences) == 2


def test_a_chat_teachers_rerendered_turns_are_refused() -> None:
    taught = trajectory(1.0)
    taught.sequences[0].rerendered = True  # a rollout server with engine.kind openai_chat or anthropic
    with pytest.raises(ValueError, match="chat teacher's re-rendered turns.*legorl collect"):
        assemble([group(taught, trajectory(0.0))], "grpo")


def test_pass_rate_per_harness_config() -> None:
    metrics = rollout_metrics([group(trajectory(1.0, "x"), trajectory(0.0, "x"), trajectory(1.0, "y"))])
    assert metrics["pass_rate/x"] == 0.5 and metrics["pass_rate/y"] == 1.0
    assert metrics["pass_rate"] == pytest.approx(2 / 3)


def test_run_log_cuts_back_to_the_resumed_step(tmp_path) -> None:
    log = RunLog(tmp_path, resume_step=0, tensorboard=True)
    for step in (1, 2, 3):
        log.write({"step": step, "kind": "train", "reward/mean": step / 10})
    log.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "torn')  # a kill mid-write
    log = RunLog(tmp_path, resume_step=2, tensorboard=True)
    log.write({"step": 3, "kind": "train", "reward/mean": 0.9})
    log.close()
    assert [(r["step"], r["reward/mean"]) for r in read_metrics(tmp_path)] == [(1, 0.1), (2, 0.2), (3, 0.9)]
    assert list((tmp_path / "tensorboard").iterdir())


def test_run_log_stamps_the_run_time_and_goes_on_from_it_on_resume(tmp_path, monkeypatch) -> None:
    clock = iter([100.0, 103.0, 110.5, 500.0, 502.0])  # opened, step 1, step 2; reopened, step 2 again
    monkeypatch.setattr("legorl_jax.train.run_log.time.monotonic", lambda: next(clock))
    log = RunLog(tmp_path, resume_step=0, tensorboard=False)
    log.write({"step": 1, "kind": "train"})
    log.write({"step": 2, "kind": "train"})
    log = RunLog(tmp_path, resume_step=1, tensorboard=False)
    log.write({"step": 2, "kind": "train"})
    assert [(r["step"], r["time/run_s"]) for r in read_metrics(tmp_path)] == [(1, 3.0), (2, 5.0)]


def test_a_graded_zero_without_a_reward_file_counts_in_pass_rates() -> None:
    """Tests broken by what the agent left are a graded 0: in the pass rate, counted apart from env failures."""
    broke_the_tests = trajectory(0.0)
    broke_the_tests.metrics.verifier_no_reward = True
    metrics = rollout_metrics([group(trajectory(1.0), broke_the_tests, trajectory(None))])
    assert metrics["pass_rate"] == 0.5 and metrics["rollout/graded"] == 2
    assert metrics["rollout/verifier_no_reward"] == 1 and metrics["rollout/env_failures"] == 1
