"""Every demo task: its reference solution scores 1 and doing nothing scores 0, in Docker and locally."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from rollout_server.sandbox.base import Sandbox
from rollout_server.sandbox.factory import SandboxFactory, spec_for_task
from rollout_server.sandbox.local import LocalSandbox, bwrap_path
from rollout_server.sandbox.reaper import TRIAL_LABEL
from rollout_server.tasks import Task, demo_tasks
from rollout_server.verifier import Verdict, run_solution, verify

TASKS = demo_tasks()
needs_bwrap = pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap (bwrap) is not installed")


def run_trial(sandbox: Sandbox, task: Task, solve: bool) -> Verdict:
    try:
        sandbox.start()
        if solve:
            result = run_solution(sandbox, task)
            assert result.ok, f"{task.name} solve.sh failed: {result.stderr[-500:]}"
        return verify(sandbox, task)
    finally:
        sandbox.stop()


@pytest.mark.docker
@pytest.mark.parametrize("task", TASKS, ids=[t.name for t in TASKS])
def test_docker_solution_scores_one_and_noop_zero(docker_factory: SandboxFactory, task: Task) -> None:
    for solve, expected in ((True, 1.0), (False, 0.0)):
        spec = spec_for_task(task, f"demo-{task.name}-{uuid.uuid4().hex[:6]}")
        verdict = run_trial(docker_factory.create(spec), task, solve)
        assert (verdict.status, verdict.reward) == ("ok", expected), verdict


@needs_bwrap
@pytest.mark.parametrize("task", TASKS, ids=[t.name for t in TASKS])
def test_local_solution_scores_one_and_noop_zero(task: Task) -> None:
    for solve, expected in ((True, 1.0), (False, 0.0)):
        sandbox = LocalSandbox(spec_for_task(task, f"demo-{task.name}"), use_bwrap=True)
        verdict = run_trial(sandbox, task, solve)
        assert (verdict.status, verdict.reward) == ("ok", expected), verdict


@pytest.mark.docker
def test_32_concurrent_docker_trials(docker_factory: SandboxFactory) -> None:
    jobs = [(TASKS[i % len(TASKS)], i % 2 == 0) for i in range(32)]
    run_id = uuid.uuid4().hex[:6]

    def trial(index: int) -> Verdict:
        task, solve = jobs[index]
        return run_trial(docker_factory.create(spec_for_task(task, f"c32-{run_id}-{index}")), task, solve)

    with ThreadPoolExecutor(max_workers=32) as pool:
        verdicts = list(pool.map(trial, range(32)))
    assert [(v.status, v.reward) for v in verdicts] == [("ok", 1.0 if solve else 0.0) for _, solve in jobs]
    assert docker_factory.client is not None
    # The low-level list: the high-level one inspects each container after listing, and fails on
    # one that something else (another suite's teardown, a reaper) removes in between.
    leftovers = docker_factory.client.api.containers(all=True, filters={"label": TRIAL_LABEL})
    assert not [c for c in leftovers if (c.get("Labels") or {}).get(TRIAL_LABEL, "").startswith(f"c32-{run_id}")]
