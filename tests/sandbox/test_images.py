"""Task images: content-hash cache, local-only images, and build errors that explain themselves."""

from __future__ import annotations

from pathlib import Path

import docker
import pytest

from rollout_server.sandbox.base import SandboxError
from rollout_server.sandbox.images import BASE_IMAGE, content_hash, ensure_task_image


def env_dir(root: Path, marker: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "Dockerfile").write_text(f"FROM {BASE_IMAGE}\nCOPY marker.txt /opt/marker.txt\n")
    (root / "marker.txt").write_text(marker)
    return root


def test_content_hash_sees_paths_bytes_and_exec_bits(tmp_path: Path) -> None:
    root = env_dir(tmp_path / "e", "one")
    first = content_hash(root)
    assert content_hash(root) == first
    (root / "marker.txt").write_text("two")
    second = content_hash(root)
    assert second != first
    (root / "marker.txt").chmod(0o755)
    assert content_hash(root) != second
    (root / "marker.txt").chmod(0o644)
    (root / "marker.txt").rename(root / "renamed.txt")
    assert content_hash(root) not in (first, second)


@pytest.mark.docker
def test_same_content_reuses_the_image_and_changes_rebuild(docker_client: docker.DockerClient, tmp_path: Path) -> None:
    root = env_dir(tmp_path / "e", f"cache-test {tmp_path.name}")
    first = ensure_task_image(docker_client, root, None)
    copy = env_dir(tmp_path / "copy", f"cache-test {tmp_path.name}")
    assert ensure_task_image(docker_client, copy, None) == first  # same bytes elsewhere: cache hit
    (root / "marker.txt").write_text("changed")
    changed = ensure_task_image(docker_client, root, None)
    assert changed != first
    for image in {first, changed}:
        docker_client.images.remove(image, force=True)


@pytest.mark.docker
def test_named_image_must_exist_locally(docker_client: docker.DockerClient) -> None:
    assert ensure_task_image(docker_client, None, BASE_IMAGE) == docker_client.images.get(BASE_IMAGE).id
    with pytest.raises(SandboxError, match="no registry"):
        ensure_task_image(docker_client, None, "python:3.12-slim")
    with pytest.raises(SandboxError, match="neither"):
        ensure_task_image(docker_client, None, None)


@pytest.mark.docker
def test_failed_build_reports_its_log(docker_client: docker.DockerClient, tmp_path: Path) -> None:
    # The failing RUN is the first step, so the failed build leaves no intermediate image behind.
    (tmp_path / "Dockerfile").write_text(f"FROM {BASE_IMAGE}\nRUN echo building-now && exit 5\n")
    with pytest.raises(SandboxError, match="building-now"):
        ensure_task_image(docker_client, tmp_path, None)
