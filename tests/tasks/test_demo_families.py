"""Generated demo task families: held-out variants are disjoint from training ones, and
every family's reference solution scores 1 while doing nothing scores 0."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from legorl_jax.core.config import DemoVariantsConfig
from rollout_server.demo_families import FAMILIES, demo_task_splits, generated_tasks, split_variants
from rollout_server.sandbox.factory import SandboxFactory, spec_for_task
from rollout_server.sandbox.local import LocalSandbox, bwrap_path
from rollout_server.tasks import Task

from .test_demo_tasks import run_trial

FAMILY_NAMES = sorted(FAMILIES)


@pytest.fixture(scope="module")
def one_per_family(tmp_path_factory: pytest.TempPathFactory) -> list[Task]:
    """The first held-out variant of every family."""
    return generated_tasks(
        "eval", FAMILY_NAMES, train_per_family=1, eval_per_family=1, cache_root=tmp_path_factory.mktemp("tasks")
    )


def test_split_is_disjoint_seeded_and_sized() -> None:
    split = split_variants(FAMILY_NAMES, train_per_family=5, eval_per_family=3, seed=7)
    train, held_out = {v.name for v in split["train"]}, {v.name for v in split["eval"]}
    assert len(train) == 5 * len(FAMILIES) and len(held_out) == 3 * len(FAMILIES)
    assert not train & held_out
    again = split_variants(FAMILY_NAMES, train_per_family=5, eval_per_family=3, seed=7)
    assert [v.name for v in again["eval"]] == [v.name for v in split["eval"]]
    other = split_variants(FAMILY_NAMES, train_per_family=5, eval_per_family=3, seed=8)
    assert [v.name for v in other["eval"]] != [v.name for v in split["eval"]]


def test_bad_requests_name_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown demo task families \\['nope'\\]"):
        split_variants(["nope"], train_per_family=1, eval_per_family=1, seed=0)
    with pytest.raises(ValueError, match="write-word has 48 variants"):
        split_variants(["write-word"], train_per_family=40, eval_per_family=9, seed=0)


def test_tasks_are_written_once_and_reused(tmp_path: Path) -> None:
    first = generated_tasks("train", ["add-setting"], train_per_family=2, eval_per_family=1, cache_root=tmp_path)
    again = generated_tasks("train", ["add-setting"], train_per_family=2, eval_per_family=1, cache_root=tmp_path)
    assert [t.root for t in first] == [t.root for t in again]
    assert len(list(tmp_path.iterdir())) == 1
    # One environment per family: every variant's image is the same content.
    environments = {(t.root / "environment" / "Dockerfile").read_text() for t in first}
    assert len(environments) == 1


def test_default_config_splits() -> None:
    splits = demo_task_splits(DemoVariantsConfig())
    assert (len(splits["train"]), len(splits["eval"])) == (120, 18)
    assert not {t.name for t in splits["train"]} & {t.name for t in splits["eval"]}


@pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap (bwrap) is not installed")
def test_local_solution_scores_one_and_noop_zero(one_per_family: list[Task]) -> None:
    for task in one_per_family:
        for solve, expected in ((True, 1.0), (False, 0.0)):
            verdict = run_trial(LocalSandbox(spec_for_task(task, f"fam-{task.name}"), use_bwrap=True), task, solve)
            assert (verdict.status, verdict.reward) == ("ok", expected), (task.name, verdict)


@pytest.mark.docker
def test_docker_solution_scores_one_and_noop_zero(docker_factory: SandboxFactory, one_per_family: list[Task]) -> None:
    for task in one_per_family:
        for solve, expected in ((True, 1.0), (False, 0.0)):
            spec = spec_for_task(task, f"fam-{task.name}-{uuid.uuid4().hex[:6]}")
            verdict = run_trial(docker_factory.create(spec), task, solve)
            assert (verdict.status, verdict.reward) == ("ok", expected), (task.name, verdict)
