"""scripts/exp_rl_vs_sft.py without training: its budget per arm, argument checks and
table; and the oracle teacher's rollouts directory as `legorl sft` reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_module import load_script

from legorl_jax.core.config import load_config
from legorl_jax.demo.demonstrations import Demonstration
from legorl_jax.demo.oracle_rollouts import write_oracle_rollouts
from legorl_jax.models.demo_assets import build_tiny_hf_model
from legorl_jax.train.collect import Keep
from legorl_jax.train.sft_data import read_sft_data

REPO = Path(__file__).resolve().parents[2]
exp = load_script("exp_rl_vs_sft")


def test_every_trained_arm_spends_the_same_episodes(tmp_path: Path) -> None:
    plan = exp.parse_args(["--runs-dir", str(tmp_path), "--episodes", "32", "--seeds", "3"])
    budgets = {arm: plan.budget(arm) for arm in exp.ARMS}
    assert budgets == {"warm": (0, 0), "sft": (32, 0), "rl": (0, 32), "sft_rl": (16, 16)}
    assert {arm: plan.rl_steps(arm) for arm in exp.ARMS} == {"warm": 0, "sft": 0, "rl": 2, "sft_rl": 1}
    config = load_config(plan.config, exp.rl_overrides(plan, "rl", 3, Path("/m")))
    assert config.total_steps * config.rl.groups_per_step * config.rl.group_size == 32
    assert not config.rl.dynamic_sampling and str(config.model.path) == "/m" and config.seed == 3
    sft = load_config(plan.config, exp.sft_overrides(plan, "sft_rl", 3))
    assert not sft.sft.evaluate and sft.logging.run_name == "sft_rl-s3-sft"
    seen = {exp.normalized(s, "seen") for s in plan.seen}
    assert seen and not seen & {exp.normalized(s, "held-out") for s in plan.held_out}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--episodes", "24"], "a multiple of 2 × groups per step × group size (32)"),
        (
            ["--held-out", json.dumps({"name": "lego", "options": {"tools": "bash_only", "prompt": "terse"}})],
            "the arms train on it",
        ),  # fmt: skip
        (["--set", "total_steps=5"], "sets total_steps itself"),
        (["--set", "model.path=/x"], "sets model.path itself"),
        (["--seeds", "1", "1"], "repeated seed"),
        (["--group-size", "1"], "--group-size: at least 2"),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument(argv: list[str], message: str) -> None:
    with pytest.raises(exp.UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        exp.parse_args(argv)


def test_table_has_each_arm_with_its_budget_and_spread(tmp_path: Path) -> None:
    plan = exp.parse_args(["--runs-dir", str(tmp_path), "--seeds", "0", "1"])
    results = [
        exp.Result(arm, seed, *plan.budget(arm), 0.5 + 0.1 * seed, 0.25, 2.0, 1.0, 60.0)
        for arm in exp.ARMS
        for seed in (0, 1)
    ]
    table = exp.build_table(plan, results)
    rows = [line for line in table.splitlines() if line.startswith("| sft_rl ")]
    assert rows == ["| sft_rl | 16 + 16 | 50.0 / 60.0 | 55.0 | sd 7.1, 50.0–60.0 | 25.0 / 25.0 | 25.0 "
                    "| sd 0.0, 25.0–25.0 | 2.00 | 1.00 | 1.0 |"]  # fmt: skip
    with pytest.raises(ValueError, match="no result for rl/s1"):
        exp.build_table(plan, [r for r in results if (r.arm, r.seed) != ("rl", 1)])


def test_oracle_episodes_are_a_rollouts_directory_sft_reads(tmp_path: Path) -> None:
    model = build_tiny_hf_model(tmp_path / "model")
    demo = Demonstration("t1", "bash_only.terse", "direct", (((5, 6, 7, 8), (0, 1, 1, 0)), ((5, 6, 9), (0, 0, 1))))
    moves = ['<tool_call>\n{"name": "bash", "arguments": {"command": "true"}}\n</tool_call>', "Done."]
    manifest = write_oracle_rollouts([demo], [moves], tmp_path / "out", model, {"seed": 0})
    assert manifest["kept"] == manifest["passed"] == 1 and manifest["tokenizer"] == str(model)
    record = json.loads((tmp_path / "out" / "rollouts.jsonl").read_text())
    assert record["metrics"]["tool_calls"] == 1 and record["metrics"]["model_calls"] == 2
    data = read_sft_data([tmp_path / "out"], Keep(passing_only=True), vocab_size=100)
    assert [s.loss_mask.tolist() for s in data.sequences] == [[False, True, True, False], [False, False, True]]
    with pytest.raises(FileExistsError):
        write_oracle_rollouts([demo], [moves], tmp_path / "out", model, {})
