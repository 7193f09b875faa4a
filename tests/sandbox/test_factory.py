"""SandboxFactory: the server's one place that picks the sandbox kind and its network."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_server.sandbox import DockerSandbox, LocalSandbox, SandboxError, SandboxFactory, spec_for_task
from rollout_server.tasks import demo_tasks, load_task

TASK = demo_tasks()[0]


def test_local_factory_makes_unisolated_sandboxes() -> None:
    factory = SandboxFactory(kind="local", network="none")
    box = factory.create(spec_for_task(TASK, "f1"))
    assert isinstance(box, LocalSandbox) and not box.isolated
    with pytest.raises(SandboxError, match="no network"):
        _ = box.proxy_host
    factory.close()


@pytest.mark.docker
def test_docker_factory_needs_the_proxy_port_for_proxy_only() -> None:
    with pytest.raises(SandboxError, match="proxy's port"):
        SandboxFactory(kind="docker", network="proxy_only")
    factory = SandboxFactory(kind="docker", network="none")
    assert isinstance(factory.create(spec_for_task(TASK, "f2")), DockerSandbox)
    factory.close()


def test_spec_takes_task_limits_capped_by_the_server(tmp_path: Path) -> None:
    spec = spec_for_task(TASK, "f3", max_cpus=0.5, max_memory_mb=256, pids_limit=99)
    assert (spec.cpus, spec.memory_mb, spec.pids_limit) == (0.5, 256, 99)
    assert spec.wall_clock_s == TASK.config.agent.timeout_sec + TASK.config.verifier.timeout_sec + 120.0
    assert spec.environment_dir == TASK.environment_dir
    (tmp_path / "tests").mkdir()
    (tmp_path / "task.toml").write_text('[environment]\ndocker_image = "img:1"\ncpus = 0.25\n')
    (tmp_path / "instruction.md").write_text("x")
    (tmp_path / "tests" / "test.sh").write_text("true")
    image_spec = spec_for_task(load_task(tmp_path), "f4", max_cpus=2)
    assert (image_spec.environment_dir, image_spec.docker_image, image_spec.cpus) == (None, "img:1", 0.25)
