"""Harness CLIs inside sandboxes that reach no registry: the host's installs, mounted read-only.

Why bind mounts rather than an image layer built FROM each task image: the CLIs
weigh ~1.3 GB (Claude Code, Codex and OpenCode ship 200-400 MB native binaries),
so a layer would copy that into every task image and again for every CLI
version, while a mount costs nothing per trial, leaves task images as small as
they are, and is read-only in the kernel: the agent (or anything else in the
container) cannot change the harness that drives it. The price is that the
host's binaries must run on the sandbox's libc; task images derive from the
Debian bookworm base, like the hosts scripts/setup prepares. Where they do not
run, the trial's install check fails and says why (an ungraded env_failure).

Sandbox layout, every path read-only:
    /opt/legorl/npm             the npm prefix; node_modules/.bin goes on PATH
    /opt/legorl/node/bin/node   the host's node, for CLIs that are node scripts
    /opt/legorl/venvN/site      a pip harness venv's site-packages
    /opt/legorl/venvN/python    the Python install that venv was made from
    /opt/legorl/venvN/bin       launchers for its console scripts (on PATH)

A venv's own `bin/` scripts name the host interpreter in their shebangs, so the
launchers run the venv's console scripts on its mounted base interpreter
instead (see venv_runner.py): the sandbox's own python3, whatever its version,
plays no part. That base must be a relocatable install (pyenv,
python-build-standalone), not the host's /usr.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from legorl_jax.core.config import HarnessToolsConfig
from rollout_server.sandbox.base import SandboxError, ToolMount

from . import venv_runner
from .base import InstallSpec

ROOT = "/opt/legorl"
NPM_DIR = f"{ROOT}/npm"
NODE_BIN_DIR = f"{ROOT}/node/bin"
_RUNNER = "venv_runner.py"


@dataclass(frozen=True)
class Provision:
    """What one trial's sandbox needs for its harness: read-only mounts and PATH entries."""

    mounts: tuple[ToolMount, ...] = ()
    path: tuple[str, ...] = ()


@dataclass(frozen=True)
class PythonVenv:
    """A host virtualenv, the Python install it was made from, and where both appear in a sandbox."""

    site_packages: Path
    base_prefix: Path
    version: str  # "3.11"
    sandbox_root: str  # /opt/legorl/venvN

    @classmethod
    def open(cls, venv: Path, sandbox_root: str) -> PythonVenv:
        found = sorted(venv.glob("lib/python3.*/site-packages"))
        if len(found) != 1:
            raise SandboxError(
                f"sandbox.harness_tools.pip_venvs: {venv} has {len(found)} "
                "lib/python3.*/site-packages directories; expected one (is it a virtualenv?)"
            )
        version = found[0].parent.name.removeprefix("python")
        cfg = venv / "pyvenv.cfg"
        home = next(
            (line.split("=", 1)[1].strip() for line in _lines(cfg) if line.split("=")[0].strip() == "home"), None
        )
        if home is None:
            raise SandboxError(f"sandbox.harness_tools.pip_venvs: {cfg} names no `home` interpreter directory")
        prefix = Path(home).resolve().parent
        if not (prefix / "bin" / f"python{version}").is_file():
            raise SandboxError(
                f"sandbox.harness_tools.pip_venvs: the base of {venv} has no bin/python{version} under {prefix}"
            )
        return cls(found[0], prefix, version, sandbox_root)

    def console_scripts(self) -> dict[str, str]:
        """Script name -> `module:attr`, for every plain-named script of every distribution."""
        scripts: dict[str, str] = {}
        for dist in metadata.distributions(path=[str(self.site_packages)]):
            for entry in dist.entry_points.select(group="console_scripts"):
                if re.fullmatch(r"[\w.-]+", entry.name) and entry.attr:
                    scripts.setdefault(entry.name, f"{entry.module}:{entry.attr}")
        return scripts

    def launcher(self, name: str, entry: str) -> str:
        """A sh script running one console script on the mounted interpreter (which finds libpython
        through LD_LIBRARY_PATH: pyenv builds link it by the host's absolute path)."""
        prefix, lib = f"{self.sandbox_root}/python", f"{self.sandbox_root}/python/lib"
        argv = [
            f"{prefix}/bin/python{self.version}",
            "-I",
            "-S",
            f"{self.sandbox_root}/bin/{_RUNNER}",
            lib,
            f"{self.sandbox_root}/site",
            entry,
            name,
        ]
        return f'#!/bin/sh\nLD_LIBRARY_PATH={shlex.quote(lib)} exec {shlex.join(argv)} "$@"\n'

    def write_launchers(self, out: Path) -> list[str]:
        shutil.copyfile(venv_runner.__file__, out / _RUNNER)
        scripts = self.console_scripts()
        for name, entry in scripts.items():
            (out / name).write_text(self.launcher(name, entry))
            (out / name).chmod(0o755)
        return sorted(scripts)

    def mounts(self, launchers: Path) -> tuple[ToolMount, ...]:
        return (
            ToolMount(self.site_packages, f"{self.sandbox_root}/site"),
            ToolMount(self.base_prefix, f"{self.sandbox_root}/python"),
            ToolMount(launchers, f"{self.sandbox_root}/bin"),
        )


class HarnessTools:
    """The host's harness installs, and how each install kind appears in a sandbox.

    Built once per server; holds temporary launcher directories while pip
    venvs are configured (removed by `close()` or at interpreter exit).
    """

    def __init__(self, npm_dir: Path | None = None, node: Path | None = None, pip_venvs: tuple[Path, ...] = ()) -> None:
        self.npm_dir = _existing_dir(npm_dir, "npm_dir") if npm_dir is not None else None
        self.node = _node_binary(node) if self.npm_dir is not None else None
        # Script name -> the venv providing it and its launcher directory; the first venv listed wins a name.
        self._scripts: dict[str, tuple[PythonVenv, Path]] = {}
        self._launchers: tempfile.TemporaryDirectory[str] | None = None
        if not pip_venvs:
            return
        venvs = [PythonVenv.open(_existing_dir(p, "pip_venvs"), f"{ROOT}/venv{i}") for i, p in enumerate(pip_venvs)]
        self._launchers = tempfile.TemporaryDirectory(prefix="legorl-launchers-")
        Path(self._launchers.name).chmod(0o755)  # the agent user runs the launchers; mkdtemp makes 0700
        for i, venv in enumerate(venvs):
            out = Path(self._launchers.name) / str(i)
            out.mkdir()
            out.chmod(0o755)  # whatever the umask
            for name in venv.write_launchers(out):
                self._scripts.setdefault(name, (venv, out))

    @classmethod
    def from_config(cls, cfg: HarnessToolsConfig) -> HarnessTools:
        return cls(
            npm_dir=Path(cfg.npm_dir) if cfg.npm_dir else None,
            node=Path(cfg.node) if cfg.node else None,
            pip_venvs=tuple(Path(v) for v in cfg.pip_venvs),
        )

    def provision(self, install: InstallSpec) -> Provision:
        """Mounts for one harness. Nothing for a kind with no host install: the task image may carry
        the CLI itself, and the trial's install check reports it when neither does."""
        if install.kind == "npm" and self.npm_dir is not None:
            if not (self.npm_dir / "node_modules" / ".bin" / install.binary).exists():
                raise SandboxError(f"{install.binary} is not in {self.npm_dir}/node_modules/.bin; run scripts/setup")
            mounts = [ToolMount(self.npm_dir, NPM_DIR)]
            if self.node is not None:
                mounts.append(ToolMount(self.node, f"{NODE_BIN_DIR}/node"))
            return Provision(tuple(mounts), (f"{NPM_DIR}/node_modules/.bin", NODE_BIN_DIR))
        if install.kind == "pip" and self._scripts:
            if install.binary not in self._scripts:
                raise SandboxError(f"{install.binary} is not a console script of any sandbox.harness_tools.pip_venvs")
            venv, launchers = self._scripts[install.binary]
            return Provision(venv.mounts(launchers), (f"{venv.sandbox_root}/bin",))
        return Provision()

    def close(self) -> None:
        if self._launchers is not None:
            self._launchers.cleanup()
            self._launchers = None


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SandboxError(f"sandbox.harness_tools.pip_venvs: cannot read {path}: {exc}") from exc


def _existing_dir(path: Path, field: str) -> Path:
    path = path.expanduser().resolve()
    if not path.is_dir():
        raise SandboxError(f"sandbox.harness_tools.{field}: {path} is not a directory")
    return path


def _node_binary(node: Path | None) -> Path | None:
    """The configured node, else the one on PATH; None leaves only CLIs that are native binaries working."""
    if node is None:
        found = shutil.which("node")
        return Path(found).resolve() if found else None
    node = node.expanduser().resolve()
    if not (node.is_file() and os.access(node, os.X_OK)):
        raise SandboxError(f"sandbox.harness_tools.node: {node} is not an executable file")
    return node
