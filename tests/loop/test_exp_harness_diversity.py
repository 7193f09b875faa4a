"""scripts/exp_harness_diversity.py without training: its argument checks, the
runs it asks `legorl train` for, and the table it builds from results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_module import load_script

from legorl_jax.core.config import load_config

REPO = Path(__file__).resolve().parents[2]
exp = load_script("exp_harness_diversity")


def lego(**options: str) -> str:
    return json.dumps({"name": "lego", "options": options})


def test_defaults_compare_two_arms_on_configurations_neither_trains_on(tmp_path: Path) -> None:
    plan = exp.parse_args(["--runs-dir", str(tmp_path)])
    assert list(plan.arms) == ["single", "diverse"] and len(plan.arms["diverse"]) > len(plan.arms["single"])
    trained = {exp.normalized(s, "arm") for mix in plan.arms.values() for s in mix}
    assert not trained & {exp.normalized(s, "held-out") for s in plan.held_out}
    assert plan.out == tmp_path / "results.md" and plan.seeds == [0, 1, 2]


def test_every_arm_gets_the_same_budget_and_its_own_mix(tmp_path: Path) -> None:
    plan = exp.parse_args(
        ["--runs-dir", str(tmp_path), "--steps", "3", "--groups-per-step", "2", "--group-size", "4", "--seeds", "7"]
    )
    configs = {arm: load_config(plan.config, exp.train_overrides(plan, arm, 7)) for arm in plan.arms}
    for arm, config in configs.items():
        assert (config.total_steps, config.rl.groups_per_step, config.rl.group_size) == (3, 2, 4)
        assert not config.rl.dynamic_sampling and config.seed == 7
        assert config.harness_mix.harnesses == plan.arms[arm]
        assert Path(config.logging.run_dir) / config.logging.run_name == tmp_path / f"{arm}-s7"
    assert plan.trials_per_run == 24


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # The same configuration spelled with a default filled in is still a trained one.
        (["--held-out", lego(tools="bash_only", prompt="terse", context="full")], "arm 'single' trains on it"),
        (["--arm", f"only=[{lego()}]"], "at least two arms"),
        (["--arm", f"a=[{lego()}]", "--arm", f"a=[{lego(tools='minimal')}]"], "--arm a: given twice"),
        (["--arm", "a=[{not json", "--arm", f"b=[{lego()}]"], "--arm a:"),
        (["--arm", f"a=[{lego(tools='hammer')}]", "--arm", f"b=[{lego()}]"], "--arm a #1: lego: invalid options"),
        (["--held-out", json.dumps({"name": "no-such-cli"})], "--held-out #1: unknown harness"),
        (
            [
                "--held-out",
                lego(tools="minimal", observation="raw"),
                "--held-out",
                lego(tools="minimal", observation="raw", context="full"),
            ],
            "given twice",
        ),
        (["--arm", "a b=[]", "--arm", f"b=[{lego()}]"], "expected NAME=JSON"),
        (["--group-size", "1"], "--group-size: at least 2"),
        (["--seeds", "1", "1"], "--seeds: repeated"),
        (["--set", "rl.group_size=8"], "the experiment sets rl.group_size itself"),
        (["--set", "harness_mix.harnesses=[]"], "the experiment sets harness_mix.harnesses"),
        (["--set", "rl.sampling.temperature=hot"], "rl.sampling.temperature"),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument(argv: list[str], message: str) -> None:
    with pytest.raises(exp.UsageError, match=message.replace("[", r"\[")):
        exp.parse_args(argv)


def test_main_exits_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert exp.main(["--steps", "0"]) == 2
    assert "--steps: at least 1, got 0" in capsys.readouterr().err


def test_table_has_mean_and_spread_per_arm_and_a_row_per_held_out_config(tmp_path: Path) -> None:
    plan = exp.parse_args(["--runs-dir", str(tmp_path), "--seeds", "0", "1"])
    # Hand-made results (a test instrument): the table's arithmetic is what is checked.
    rates = {"warm start": (0.2, 0.4), "single": (0.25, 0.35), "diverse": (0.5, 0.7)}
    results = []
    for arm, pair in rates.items():
        for seed, rate in zip((0, 1), pair, strict=True):
            result = exp.result_from_eval(
                arm, seed, {"eval_pass_rate": rate, "eval_reward": rate, "eval_pass_rate/x": rate, "other": 1.0}
            )
            result.per_harness[exp.harness_choice(plan.held_out[2]).config_id] = rate
            if arm != "warm start":
                result.train_trials, result.seen_pass_rate = 48, 0.9
            results.append(result)
    table = exp.build_table(plan, results)
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert rows["diverse"] == "| diverse | 4 | 48 | 50.0 | 70.0 | 60.0 | sd 14.1, 50.0–70.0 | 90.0 |"
    assert rows["warm start"] == "| warm start | – | 0 | 20.0 | 40.0 | 30.0 | sd 14.1, 20.0–40.0 | – |"
    assert rows["`x`"] == "| `x` | 30.0 | 30.0 | 60.0 |"
    digest_id = exp.harness_choice(plan.held_out[2]).config_id  # too long to spell in metrics
    assert digest_id.startswith("lego~") and digest_id not in table
    assert "| `lego observation=raw prompt=terse tools=bash_only turn_budget=short` |" in table
    with pytest.raises(ValueError, match="no result for single/s1"):
        exp.build_table(plan, [r for r in results if (r.arm, r.seed) != ("single", 1)])


def test_train_summary_counts_training_trials_and_reads_the_last_eval(tmp_path: Path) -> None:
    records = [
        {"step": 0, "kind": "eval", "eval_pass_rate": 0.1},
        {"step": 1, "kind": "train", "rollout/trials": 8.0},
        {"step": 2, "kind": "train", "rollout/trials": 8.0},
        {"step": 2, "kind": "eval", "eval_pass_rate": 0.6},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert exp.train_summary(tmp_path) == (16, 0.6)
