"""The shipped example configs, as a user meets them: `legorl config show` prints
each one, the printout loads back to the same config, and each example is
internally consistent (limits that only fail deep inside a run otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest

from legorl_jax.cli import main
from legorl_jax.core.config import CONFIG_DIR, Config, load_config

EXAMPLES = sorted(CONFIG_DIR.glob("*.yaml"))


def test_the_examples_named_in_the_docs_ship() -> None:
    assert {"demo.yaml", "qwen3_8b_v5p.yaml", "qwen3_30b_a3b.yaml"} <= {p.name for p in EXAMPLES}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_config_show_prints_a_config_that_loads_back_unchanged(
    path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "show", "--config", str(path)]) == 0
    shown = tmp_path / "shown.yaml"
    shown.write_text(capsys.readouterr().out)
    assert load_config(shown) == load_config(path)


def consistency_problems(config: Config) -> list[str]:
    """What in one config contradicts another part of it."""
    problems = []
    buckets = config.learner.length_buckets
    if buckets != sorted(set(buckets)):
        problems.append(f"learner.length_buckets {buckets} not strictly increasing")
    if max(buckets) > config.model.max_seq_len:
        problems.append(f"largest length bucket {max(buckets)} > model.max_seq_len {config.model.max_seq_len}")
    if config.learner.micro_batch_tokens < max(buckets):
        problems.append("learner.micro_batch_tokens cannot hold one row of the largest bucket")
    if config.engine.max_context is not None and config.rl.sampling.max_tokens > config.engine.max_context:
        problems.append("rl.sampling.max_tokens exceeds engine.max_context")
    if config.proxy.max_total_tokens < config.rl.sampling.max_tokens:
        problems.append("proxy.max_total_tokens is below one model call's completion cap")
    if config.learner.optimizer.schedule != "constant" and config.learner.optimizer.total_steps < config.total_steps:
        problems.append("the learning-rate schedule decays to its end before total_steps")
    if config.fleet.servers:
        step_trials = config.rl.group_size * config.rl.groups_per_step
        fleet_slots = len(config.fleet.servers) * config.fleet.capacity_per_server
        if fleet_slots < step_trials:
            problems.append(f"fleet runs {fleet_slots} trials at once, a step needs {step_trials}")
        if len(set(config.fleet.servers)) != len(config.fleet.servers):
            problems.append("fleet.servers lists an address twice")
    return problems


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_internally_consistent(path: Path) -> None:
    assert consistency_problems(load_config(path)) == []


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (["learner.length_buckets=[2048, 1024]"], "not strictly increasing"),
        (["model.max_seq_len=1024", "learner.length_buckets=[1024, 2048]"], "> model.max_seq_len"),
        (["rl.sampling.max_tokens=100000", "engine.max_context=4096"], "exceeds engine.max_context"),
        (["fleet.servers=[a:1, a:1]"], "an address twice"),
        (
            ["fleet.servers=[a:1]", "fleet.capacity_per_server=8", "rl.group_size=4", "rl.groups_per_step=4"],
            "fleet runs 8 trials at once, a step needs 16",
        ),
    ],
)
def test_consistency_check_catches_a_broken_example(overrides: list[str], problem: str) -> None:
    problems = consistency_problems(load_config(None, overrides))
    assert any(problem in p for p in problems), problems
