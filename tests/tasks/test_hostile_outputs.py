"""Every shipped task against a generic hostile agent: each attack ends as a graded 0.

The shipped tasks are the hand-written demo tasks and one variant of every
generated demo family. An attack that earned a reward, or that turned its
certain 0 into "ungraded" (`env_failure`), fails the test; so does an attack
that did not run. The reference solution scoring 1 on the same tasks is
tests/tasks/test_demo_tasks.py's and test_demo_families.py's job.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from rollout_server.demo_families import FAMILIES, generated_tasks
from rollout_server.sandbox.base import AGENT_USER
from rollout_server.sandbox.factory import SandboxFactory, spec_for_task
from rollout_server.tasks import Task, demo_tasks
from rollout_server.verifier import Verdict, verify

from .hostile_agent import DONE, attacks

pytestmark = pytest.mark.docker


def shipped_tasks() -> list[Task]:
    families = generated_tasks("eval", sorted(FAMILIES), train_per_family=1, eval_per_family=1)
    return [*demo_tasks(), *families]


TASKS = shipped_tasks()


def attacked(factory: SandboxFactory, task: Task, script: str) -> tuple[Verdict, str]:
    box = factory.create(spec_for_task(task, f"hostile-{task.name[:20]}-{uuid.uuid4().hex[:6]}"))
    try:
        box.start()
        ran = box.exec(["bash", "-c", script], timeout=60, user=AGENT_USER)
        if DONE not in ran.stdout:
            # Attacks are idempotent; a loaded Docker 20.10 daemon has been seen to lose an exec's output.
            ran = box.exec(["bash", "-c", script], timeout=60, user=AGENT_USER)
        return verify(box, task), f"exit {ran.exit_code}: {ran.stdout}{ran.stderr}"
    finally:
        box.stop()


@pytest.mark.parametrize("task", TASKS, ids=[t.name for t in TASKS])
def test_no_hostile_output_earns_a_reward_or_escapes_grading(docker_factory: SandboxFactory, task: Task) -> None:
    scripts = attacks(task)
    with ThreadPoolExecutor(max_workers=4) as pool:
        outcomes = dict(
            zip(scripts, pool.map(lambda s: attacked(docker_factory, task, s), scripts.values()), strict=True)
        )
    for name, (verdict, output) in outcomes.items():
        assert DONE in output, (name, output[-500:])
        assert verdict.status in ("ok", "no_reward"), (name, verdict.reason, verdict.stderr[-500:])
        assert verdict.reward == 0.0, (name, verdict)
