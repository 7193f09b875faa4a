"""The CLI demo model's spec: a variant of the demo model's build, keyed on what shapes CLI episodes."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from legorl_jax.demo import demo_model
from legorl_jax.demo.cli_demonstrations import CLI_MOVES, CLI_PINS
from legorl_jax.demo.cli_model import CLI_DEMO_SPEC, TASKS_PER_FAMILY, cli_demo_tasks
from legorl_jax.demo.demo_model import BUILD_INFO, DemoModelSpec, cache_key, ensure_demo_model
from legorl_jax.demo.sft import SFTConfig
from legorl_jax.models import from_hf


def test_cli_tasks_take_the_first_variants_of_every_family() -> None:
    tasks = cli_demo_tasks()
    families = Counter(next(t for t in task.config.metadata["tags"] if t != "demo") for task in tasks)
    assert len(families) == 6 and set(families.values()) == {TASKS_PER_FAMILY}


def test_the_cli_spec_records_through_known_clis_and_hashes_their_sources() -> None:
    assert set(CLI_DEMO_SPEC.cli_harnesses) <= set(CLI_MOVES) and CLI_DEMO_SPEC.harnesses == ()
    sources = dict(demo_model._source_files(CLI_DEMO_SPEC))
    lego_sources = dict(demo_model._source_files(DemoModelSpec()))
    assert "legorl_jax.demo.cli_demonstrations" in sources and "harnesses/claude_code.py" in sources
    assert {pin.name for pin in CLI_PINS} <= set(sources)
    # The lego demo model's key does not move with the CLI recorder's source; both keys move with the warm start's.
    assert "legorl_jax.demo.cli_demonstrations" not in lego_sources
    assert "legorl_jax.demo.sft" in sources and "legorl_jax.demo.sft" in lego_sources


def test_the_lego_stage_is_only_a_first_stage_of_a_cli_build() -> None:
    with pytest.raises(ValueError, match="lego_stage"):
        DemoModelSpec(lego_stage=SFTConfig())


def test_cache_key_moves_with_the_cli_harnesses() -> None:
    tasks = cli_demo_tasks(per_family=1)[:1]
    key = cache_key(CLI_DEMO_SPEC, tasks, [])
    fewer = CLI_DEMO_SPEC.model_copy(update={"cli_harnesses": CLI_DEMO_SPEC.cli_harnesses[:1]})
    assert cache_key(fewer, tasks, []) != key
    assert cache_key(CLI_DEMO_SPEC, tasks, []) == key


def _tiny_spec(**update: Any) -> DemoModelSpec:
    """The CLI spec through mini-swe-agent alone, at a model and vocabulary that train in milliseconds."""
    shape = {"vocab_size": 768, "hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}
    return CLI_DEMO_SPEC.model_copy(
        update={
            "cli_harnesses": ("mini-swe-agent",),
            **shape,
            "head_dim": 16,
            "intermediate_size": 64,
            "max_context": 4096,
            **update,
        }
    )


@pytest.mark.docker
@pytest.mark.npm
@pytest.mark.slow  # the whole build with demonstrations recorded through a real CLI in Docker
def test_a_tiny_cli_build_records_through_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = cli_demo_tasks(per_family=1)[:1]
    # The lego stage records configs/demo.yaml's lego configurations on one task here (all its tasks in the real build).
    monkeypatch.setattr(demo_model, "demo_training_tasks", lambda: task)
    two_steps = SFTConfig(max_steps=2, batch_size=1, eval_every=2, target_pass=1.0)
    tiny = _tiny_spec(sft=two_steps, lego_stage=two_steps)
    built = ensure_demo_model(tmp_path, progress=False, spec=tiny, tasks=task)
    info = json.loads((built / BUILD_INFO).read_text())
    lego_configs = len(demo_model.demo_harness_options())
    assert info["lego_stage"]["sft_steps"] == 2
    assert info["lego_stage"]["demonstrations"] == lego_configs * len(tiny.plans)
    # One working episode and the habit (mini-swe-agent retries a prose answer: one sequence per try).
    assert info["demonstrations"] == 2 and info["sft_steps"] == 2
    assert info["sequences"] >= 2 and info["padded_length"] <= tiny.max_context
    assert from_hf(built).config.vocab_size == 768


@pytest.mark.timeout(300)
def test_a_failed_cli_recording_stops_the_lego_stage_beside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = cli_demo_tasks(per_family=1)[:1]
    monkeypatch.setattr(demo_model, "demo_training_tasks", lambda: task)
    # A stage that would train for hours unless stopped.
    endless = SFTConfig(max_steps=1_000_000, batch_size=1, eval_every=1_000_000, target_pass=1.0)
    tiny = _tiny_spec(lego_stage=endless)
    stage_steps: list[int] = []
    steps_at_failure: list[int] = []
    record, train = demo_model._record, demo_model._train

    def failing_record(*args: Any, through_clis: bool = True) -> Any:
        if through_clis and args[4] == tiny.max_context:  # the CLIs' demonstrations (tokenizer text: lego's)
            deadline = time.monotonic() + 240
            while len(stage_steps) < 3 and time.monotonic() < deadline:
                time.sleep(0.1)
            steps_at_failure.append(len(stage_steps))
            raise RuntimeError("the Docker engine went away")
        return record(*args, through_clis=False)

    def counting_train(*args: Any) -> Any:
        sft_train = demo_model.train_sft

        def train_sft(*a: Any, on_step: Any) -> Any:
            def count(step: int, loss: float, estimate: float | None) -> None:
                stage_steps.append(step)
                on_step(step, loss, estimate)

            return sft_train(*a, on_step=count)

        monkeypatch.setattr(demo_model, "train_sft", train_sft)
        return train(*args)

    monkeypatch.setattr(demo_model, "_record", failing_record)
    monkeypatch.setattr(demo_model, "_train", counting_train)
    with pytest.raises(RuntimeError, match="Docker engine went away"):
        ensure_demo_model(tmp_path, progress=False, spec=tiny, tasks=task)
    # The stage trained beside the recording and stopped within a step of the failure (a step here
    # takes milliseconds: a few may finish between the failure and the stop event being set).
    stopped_at = len(stage_steps)
    assert 3 <= steps_at_failure[0] <= stopped_at <= steps_at_failure[0] + 3, (steps_at_failure, stage_steps)
    time.sleep(1)
    assert len(stage_steps) == stopped_at


@pytest.mark.parametrize("kind", ["lego", "cli"])
def test_the_run_config_chooses_which_demo_model_to_build(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from legorl_jax import wiring
    from legorl_jax.core.config import load_config

    built: list[tuple[str, Path]] = []
    # Spies in place of the builds (minutes to an hour): only which one the run asks for is under test.
    monkeypatch.setattr(wiring, "ensure_demo_model", lambda cache, progress: built.append(("lego", cache)) or cache)
    monkeypatch.setattr(wiring, "ensure_cli_demo_model", lambda cache, progress: built.append(("cli", cache)) or cache)
    monkeypatch.setenv("LEGORL_CACHE", str(tmp_path))
    config = load_config(overrides=[f"model.demo_model={kind}"])
    assert wiring.model_dir(config, progress=False) == tmp_path / "demo_model"
    assert built == [(kind, tmp_path / "demo_model")]
    given = load_config(overrides=[f"model.demo_model={kind}", f"model.path={tmp_path / 'hf'}"])
    assert wiring.model_dir(given, progress=False) == tmp_path / "hf" and len(built) == 1


def test_the_cli_demo_config_builds_the_cli_model() -> None:
    from legorl_jax.core.config import REPO_ROOT, load_config

    config = load_config(REPO_ROOT / "configs" / "demo_cli.yaml")
    assert config.model.path is None and config.model.demo_model == "cli"
    assert {h.name for h in config.harness_mix.harnesses} == set(CLI_DEMO_SPEC.cli_harnesses)
