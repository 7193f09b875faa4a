"""Local images: the base rootfs import and task images cached by content hash.

There is no registry on these hosts, so `FROM debian` cannot pull. The base
image is a Debian minbase rootfs made with debootstrap (from Debian's package
mirror) and `docker import`ed once; task Dockerfiles start `FROM
legorl/base:bookworm`. A task image is tagged with the hash of its
environment directory and the base image id, so an unchanged task is never
rebuilt and a changed one never reuses a stale image.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import docker
import docker.errors
from docker.models.images import Image

from rollout_server.sandbox.base import AGENT_USER, SandboxError

log = logging.getLogger(__name__)

BASE_IMAGE = "legorl/base:bookworm"
TASK_IMAGE_REPO = "legorl/task-env"
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("LEGORL_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# python3 (with its standard library): task tests are mostly Python; procps: ps/pkill.
BASE_PACKAGES = ("python3", "procps")
# Docs, man pages and apt indexes are a third of a minbase rootfs and no task needs them.
_PRUNE = ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale", "var/lib/apt/lists", "var/cache/apt")

# Finishes the imported rootfs: the unprivileged agent account and Harbor's log dirs,
# root-owned so only the verifier (root) can write /logs/verifier.
_BASE_DOCKERFILE = f"""\
FROM {BASE_IMAGE}-rootfs
RUN useradd --create-home --uid 1000 --shell /bin/bash {AGENT_USER} \\
 && mkdir -p /app /logs/agent /logs/verifier \\
 && chown {AGENT_USER}:{AGENT_USER} /app /logs/agent
ENV LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1
WORKDIR /app
CMD ["/bin/bash"]
"""

_build_locks: dict[str, threading.Lock] = {}
_build_locks_guard = threading.Lock()


def _lock_for(key: str) -> threading.Lock:
    with _build_locks_guard:
        return _build_locks.setdefault(key, threading.Lock())


def _image_or_none(client: docker.DockerClient, ref: str) -> Image | None:
    try:
        return client.images.get(ref)
    except docker.errors.ImageNotFound:
        return None


def _debootstrap(target: Path) -> None:
    if shutil.which("debootstrap") is None:
        raise SandboxError("building the base image needs debootstrap (apt-get install debootstrap)")
    cmd = [
        "debootstrap",
        "--variant=minbase",
        f"--include={','.join(BASE_PACKAGES)}",
        DEBIAN_SUITE,
        str(target),
        DEBIAN_MIRROR,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SandboxError(f"debootstrap failed ({proc.returncode}): {proc.stderr[-2000:] or proc.stdout[-2000:]}")
    for rel in _PRUNE:
        shutil.rmtree(target / rel, ignore_errors=True)


def _docker_import(client: docker.DockerClient, rootfs: Path, ref: str) -> None:
    # Stream the tar straight from `tar` to the daemon's import endpoint: no 150 MB buffer in memory.
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
    assert tar.stdout is not None
    repository, tag = ref.rsplit(":", 1)
    try:
        client.api.import_image_from_stream(tar.stdout, repository=repository, tag=tag)
    finally:
        tar.stdout.close()
        if tar.wait() != 0:
            raise SandboxError(f"tar of the rootfs {rootfs} failed")


def ensure_base_image(client: docker.DockerClient) -> Image:
    """Build legorl/base:bookworm from a debootstrap rootfs unless it is already there."""
    with _lock_for(BASE_IMAGE):
        image = _image_or_none(client, BASE_IMAGE)
        if image is not None:
            return image
        rootfs_ref = f"{BASE_IMAGE}-rootfs"
        if _image_or_none(client, rootfs_ref) is None:
            log.info("building %s with debootstrap from %s (one-time, ~1 min)", rootfs_ref, DEBIAN_MIRROR)
            with tempfile.TemporaryDirectory(prefix="legorl-rootfs-") as tmp:
                rootfs = Path(tmp) / "rootfs"
                _debootstrap(rootfs)
                _docker_import(client, rootfs, rootfs_ref)
        return _build(client, io.BytesIO(_BASE_DOCKERFILE.encode()), BASE_IMAGE, timeout_s=600)


def _build(client: docker.DockerClient, context: io.BytesIO | Path, tag: str, timeout_s: float) -> Image:
    try:
        if isinstance(context, Path):
            image, _ = client.images.build(
                path=str(context), tag=tag, rm=True, forcerm=True, pull=False, timeout=int(timeout_s)
            )
        else:
            image, _ = client.images.build(
                fileobj=context, tag=tag, rm=True, forcerm=True, pull=False, timeout=int(timeout_s)
            )
    except docker.errors.BuildError as exc:
        tail = "".join(str(chunk.get("stream") or chunk.get("error") or "") for chunk in exc.build_log)[-2000:]
        raise SandboxError(f"image build of {tag} failed: {exc.msg}\n{tail}") from exc
    except docker.errors.APIError as exc:
        raise SandboxError(f"image build of {tag} failed: {exc}") from exc
    return image


def content_hash(directory: Path) -> str:
    """sha256 over every file's relative path, executable bit and bytes, in a fixed order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file() or p.is_symlink()):
        rel = path.relative_to(directory).as_posix()
        digest.update(rel.encode() + b"\0")
        if path.is_symlink():
            digest.update(b"L" + os.readlink(path).encode())
        else:
            digest.update(b"X" if os.access(path, os.X_OK) else b"F")
            digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def ensure_task_image(
    client: docker.DockerClient,
    environment_dir: Path | None,
    docker_image: str | None,
    build_timeout_s: float = 600.0,
) -> str:
    """The image id a trial runs: the task's Dockerfile built once per content, or its named local image."""
    dockerfile = environment_dir / "Dockerfile" if environment_dir is not None else None
    if dockerfile is None or not dockerfile.is_file():
        if docker_image is None:
            raise SandboxError("task has neither environment/Dockerfile nor [environment].docker_image")
        image = _image_or_none(client, docker_image)
        if image is None:
            raise SandboxError(f"image {docker_image!r} is not present locally, and there is no registry to pull from")
        return str(image.id)
    assert environment_dir is not None
    if BASE_IMAGE in dockerfile.read_text(encoding="utf-8", errors="replace"):
        base_id = str(ensure_base_image(client).id)
    else:
        base_id = "external-base"
    key = hashlib.sha256((content_hash(environment_dir) + base_id).encode()).hexdigest()[:20]
    tag = f"{TASK_IMAGE_REPO}:{key}"
    with _lock_for(tag):
        image = _image_or_none(client, tag)
        if image is None:
            log.info("building task image %s from %s", tag, environment_dir)
            image = _build(client, environment_dir, tag, build_timeout_s)
        return str(image.id)


def main() -> int:
    """`python -m rollout_server.sandbox.images`: build the base image and every demo task image, the
    generated variants of configs/demo.yaml included (setup, CI)."""
    import time

    from legorl_jax.core.config import DEFAULT_CONFIG, load_config
    from rollout_server.demo_families import all_demo_tasks

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    client = docker.from_env(timeout=600)
    began = time.perf_counter()
    ensure_base_image(client)
    log.info("%s ready in %.1fs", BASE_IMAGE, time.perf_counter() - began)
    for task in all_demo_tasks(load_config(DEFAULT_CONFIG).tasks.demo_variants):
        ensure_task_image(client, task.environment_dir, task.config.environment.docker_image)
    log.info("demo task images ready in %.1fs", time.perf_counter() - began)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
