"""Per-harness results: `harness/<config id>/…` in train and eval records, as
TensorBoard scalars, and one held-out line per harness in `reward.png`."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from tensorboardX.proto import event_pb2

from legorl_jax.fleet import GroupResult, GroupSpec
from legorl_jax.train.assemble import rollout_metrics
from legorl_jax.train.harness_metrics import harness_metrics
from legorl_jax.train.harness_table import TABLE_FILE, harness_table, write_harness_table
from legorl_jax.train.plot import harness_lines, plot_run
from legorl_jax.train.run_log import RunLog
from protos.legorl.v1 import rollout_pb2 as pb


def trial(
    config_id: str,
    reward: float | None,
    *,
    tool_calls: int = 0,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    roots: tuple[str, ...] = ("first_call",),
) -> pb.Trajectory:
    t = pb.Trajectory(
        harness=pb.HarnessConfig(name=config_id.split("[")[0], config_id=config_id),
        status=pb.TRIAL_STATUS_OK if reward is not None else pb.TRIAL_STATUS_ENV_FAILURE,
        sequences=[pb.TokenSequence(root_reason=r, side_call=r == "side_call") for r in roots],
    )
    if reward is not None:
        t.reward = reward
    t.metrics.model_calls = len(roots) + 1
    t.metrics.tool_calls = tool_calls
    t.metrics.prompt_tokens = prompt_tokens
    t.metrics.completion_tokens = completion_tokens
    return t


def test_each_configuration_gets_its_pass_rate_costs_and_prefix_merging() -> None:
    trials = [
        trial("codex", 1.0, tool_calls=3, prompt_tokens=1000, completion_tokens=40, roots=("first_call",)),
        trial(
            "codex",
            0.0,
            tool_calls=1,
            prompt_tokens=3000,
            completion_tokens=20,
            roots=("side_call", "first_call", "history_rewritten", "restart"),
        ),
        trial("codex", None),  # an env failure: counted, but no episode to average over
        trial("lego[tools=minimal]", 1.0, tool_calls=2, prompt_tokens=500, completion_tokens=10),
    ]
    m = harness_metrics(trials)
    codex = {k.removeprefix("harness/codex/"): v for k, v in m.items() if k.startswith("harness/codex/")}
    assert codex == {
        "trials": 3.0,
        "graded": 2.0,
        "env_failures": 1.0,
        "pass_rate": 0.5,
        "reward_mean": 0.5,
        "model_calls_per_episode": 3.5,
        "tool_calls_per_episode": 2.0,
        "tool_parse_errors_per_episode": 0.0,
        "prompt_tokens_per_episode": 2000.0,
        "completion_tokens_per_episode": 30.0,
        "sequences_per_trajectory": 2.5,
        "false_forks_per_trajectory": 1.0,
        "side_sequences_per_trajectory": 0.5,
    }
    assert m["harness/lego[tools=minimal]/pass_rate"] == 1.0
    assert m["harness/lego[tools=minimal]/false_forks_per_trajectory"] == 0.0


def test_only_env_failures_report_no_episode_means() -> None:
    m = harness_metrics([trial("opencode", None), trial("opencode", None)])
    assert m == {"harness/opencode/trials": 2.0, "harness/opencode/graded": 0.0, "harness/opencode/env_failures": 2.0}


def test_rollout_metrics_carry_them_and_tensorboard_gets_every_one(tmp_path: Path) -> None:
    spec = GroupSpec(pb.TaskRef(task_id="t"), pb.HarnessConfig(name="lego"), 3, pb.SamplingParams(), 0)
    group = GroupResult(spec, "g", [trial("a", 1.0, tool_calls=2), trial("a", 0.0), trial("b", 1.0)])
    metrics = rollout_metrics([group])
    per_harness = {k: v for k, v in metrics.items() if k.startswith("harness/")}
    assert per_harness == harness_metrics(group.trajectories)
    assert metrics["harness/a/tool_calls_per_episode"] == 1.0 and metrics["harness/b/pass_rate"] == 1.0

    log = RunLog(tmp_path, resume_step=0, tensorboard=True)
    log.write({"step": 1, "kind": "train", **metrics})
    log.close()
    tags = {value.tag for event in tensorboard_events(tmp_path / "tensorboard") for value in event.summary.value}
    assert set(per_harness) <= tags


def tensorboard_events(folder: Path) -> list[event_pb2.Event]:
    """Every event in the folder's TFRecord files (length, CRC, data, CRC; CRCs not checked)."""
    events = []
    for path in sorted(folder.iterdir()):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack_from("<Q", data, at)
            events.append(event_pb2.Event.FromString(data[at + 12 : at + 12 + length]))
            at += 12 + length + 4
    return events


def write_metrics(run_dir: Path, harnesses: list[str]) -> None:
    run_dir.mkdir()
    records = []
    for step in (0, 1, 2):
        if step:
            records.append({"step": step, "kind": "train", "reward/mean": 0.2 * step, "pass_rate": 0.1 * step})
        evaluation = {"step": step, "kind": "eval", "eval_pass_rate": 0.3 + 0.1 * step}
        evaluation.update({f"eval_pass_rate/{h}": 0.1 * i + 0.05 * step for i, h in enumerate(harnesses)})
        records.append(evaluation)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("count", [2, 8])
def test_reward_png_has_a_held_out_line_per_harness(tmp_path: Path, count: int) -> None:
    harnesses = [f"lego[prompt=p{i},tools=minimal]" for i in range(count - 1)] + ["codex"]
    write_metrics(tmp_path / "run", harnesses)
    lines = harness_lines([json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()])
    assert list(lines) == sorted(harnesses)
    assert lines["codex"] == [(step, pytest.approx(0.1 * (count - 1) + 0.05 * step)) for step in (0, 1, 2)]
    out = plot_run(tmp_path / "run")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def eval_record(step: int, trials: list[pb.Trajectory]) -> dict[str, object]:
    """An evaluation's metrics record as the loop writes it (`evaluate`'s keys)."""
    metrics = harness_metrics(trials)
    graded = [t.reward >= 1.0 for t in trials if t.HasField("reward")]
    return {"step": step, "kind": "eval", "eval_pass_rate": sum(graded) / len(graded)} | {
        f"eval_{k}": v for k, v in metrics.items()
    }


def test_harness_table_sets_each_configuration_first_evaluation_beside_its_last(tmp_path: Path) -> None:
    first = [trial("codex", 0.0, prompt_tokens=9000), trial("codex", 1.0, tool_calls=2, prompt_tokens=9000)]
    first += [trial("opencode", 0.0), trial("opencode", None)]
    last = [trial("codex", 1.0, tool_calls=1, prompt_tokens=9200), trial("codex", 1.0, tool_calls=3)]
    last += [trial("opencode", 1.0, tool_calls=1), trial("opencode", 0.0)]
    records = [eval_record(0, first), {"step": 1, "kind": "train", "harness/codex/pass_rate": 1.0}]
    assert harness_table(records) is None  # one evaluation: nothing to compare yet
    records.append(eval_record(4, last))
    table = harness_table(records)
    assert table is not None
    cells = [line.split(" | ") for line in table.splitlines() if line.startswith("| `")]
    rows = {row[0].strip("| `"): row for row in cells}
    assert set(rows) == {"codex", "opencode"}
    assert rows["codex"][1:4] == ["0.50 → 1.00", "+50.0", "2 → 2"]
    assert rows["codex"][4] == "1.00 → 2.00" and rows["codex"][5] == "9,000 → 4,600"
    # opencode's env failure at step 0 is counted there and left out of its pass rate.
    assert rows["opencode"][1:3] == ["0.00 → 0.50", "+50.0"] and rows["opencode"][7] == "1 → 0"
    assert "step 0 → step 4" in table and "All harnesses: 0.33 → 0.75." in table

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    written = write_harness_table(run)
    assert written == run / TABLE_FILE and written.read_text() == table
