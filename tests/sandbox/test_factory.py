"""SandboxFactory: the server's one place that picks the sandbox kind and its network."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import rollout_server.sandbox.factory as sandbox_factory
from legorl_jax.core.config import SandboxConfig, load_config
from rollout_server.sandbox.base import SandboxError
from rollout_server.sandbox.docker import DockerSandbox
from rollout_server.sandbox.factory import SandboxFactory, spec_for_task
from rollout_server.sandbox.local import LocalSandbox, bwrap_path
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
    (tmp_path / "task.toml").write_text('[environment]\ndocker_image = "img:1"\ncpus = 0.25\nstorage_mb = 20\n')
    (tmp_path / "instruction.md").write_text("x")
    (tmp_path / "tests" / "test.sh").write_text("true")
    image_spec = spec_for_task(load_task(tmp_path), "f4", max_cpus=2)
    assert (image_spec.environment_dir, image_spec.docker_image, image_spec.cpus) == (None, "img:1", 0.25)
    assert (image_spec.storage_mb, spec.storage_mb) == (20, None)


def test_auto_never_falls_back_to_the_local_sandbox_silently(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sandbox_factory, "docker_client_or_none", lambda: None)
    with pytest.raises(SandboxError, match="sandbox.allow_local_fallback"):
        SandboxFactory(kind="auto", network="proxy_only", proxy_port=9)
    with caplog.at_level(logging.WARNING):
        factory = SandboxFactory(kind="auto", network="proxy_only", proxy_port=9, allow_local_fallback=True)
    assert factory.kind == "local" and "NOT isolated" in caplog.text
    box = factory.create(spec_for_task(TASK, "f5"))
    # Its own network namespace reaching only the proxy, wherever bubblewrap can make one.
    assert isinstance(box, LocalSandbox) and box.network_isolated == (bwrap_path() is not None)
    factory.close()


def test_only_the_demo_config_opts_in_to_the_local_fallback() -> None:
    assert SandboxConfig().allow_local_fallback is False
    assert load_config(None).sandbox.allow_local_fallback is True
