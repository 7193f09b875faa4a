"""Harness tools: what a trial's sandbox gets mounted for its harness, and the launchers
that run a mounted venv's console scripts on the sandbox's own python3.

The Docker side (the mounts really are read-only, the CLIs really run) is
tests/rollout/test_cli_in_docker.py; these need no Docker.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from legorl_jax.core.config import load_config
from rollout_server.harnesses import get_harness, venv_runner
from rollout_server.harnesses.base import CliHarness, InstallSpec
from rollout_server.harnesses.tools import HarnessTools, Provision
from rollout_server.sandbox.base import SandboxError, ToolMount
from rollout_server.sandbox.docker import _bind_mounts

HOST_VERSION = f"{sys.version_info[0]}.{sys.version_info[1]}"
BASE_PREFIX = Path(sys.base_prefix).resolve()


def npm_prefix(root: Path, *binaries: str) -> Path:
    bin_dir = root / "npm" / "node_modules" / ".bin"
    bin_dir.mkdir(parents=True)
    for name in binaries:
        (bin_dir / name).write_text("#!/bin/sh\n")
    return root / "npm"


def executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def venv(root: Path, version: str = HOST_VERSION) -> Path:
    """A virtualenv made from this host's Python, holding one distribution, `demo-cli`, whose console
    script `democli` prints its argv and exits with the number of arguments."""
    site = root / "venv" / "lib" / f"python{version}" / "site-packages"
    (site / "demo_cli").mkdir(parents=True)
    (site / "demo_cli" / "__init__.py").write_text("")
    (site / "demo_cli" / "main.py").write_text(
        "import sys\n\n"
        "class App:\n"
        "    @staticmethod\n"
        "    def run():\n"
        "        print(sys.argv)\n"
        "        return len(sys.argv) - 1\n"
    )
    info = site / "demo_cli-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: demo-cli\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[console_scripts]\ndemocli = demo_cli.main:App.run\n")
    (root / "venv" / "pyvenv.cfg").write_text(f"home = {BASE_PREFIX}/bin\nversion = {version}.0\n")
    return root / "venv"


def install_of(name: str) -> InstallSpec:
    harness = get_harness(name)
    assert isinstance(harness, CliHarness)
    return harness.install_spec(harness.parse_options({}))


def test_npm_harness_gets_the_prefix_and_node_read_only(tmp_path: Path) -> None:
    prefix = npm_prefix(tmp_path, "claude")
    node = executable(tmp_path / "node")
    tools = HarnessTools(npm_dir=prefix, node=node)
    assert tools.provision(install_of("claude-code")) == Provision(
        mounts=(ToolMount(prefix.resolve(), "/opt/legorl/npm"), ToolMount(node.resolve(), "/opt/legorl/node/bin/node")),
        path=("/opt/legorl/npm/node_modules/.bin", "/opt/legorl/node/bin"),
    )
    with pytest.raises(SandboxError, match=r"codex is not in .*node_modules/\.bin"):
        tools.provision(install_of("codex"))
    # No host install of the kind: nothing mounted, the task image must carry the CLI.
    assert tools.provision(install_of("mini-swe-agent")) == Provision()
    assert tools.provision(get_harness("lego").install) == Provision()


def test_bad_paths_are_refused_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(SandboxError, match=r"harness_tools\.npm_dir: .* is not a directory"):
        HarnessTools(npm_dir=tmp_path / "missing")
    not_executable = tmp_path / "node"
    not_executable.write_text("")
    with pytest.raises(SandboxError, match=r"harness_tools\.node: .* not an executable"):
        HarnessTools(npm_dir=npm_prefix(tmp_path), node=not_executable)
    (tmp_path / "not-a-venv").mkdir()
    with pytest.raises(SandboxError, match=r"harness_tools\.pip_venvs: .* 0 lib/python3\.\*/site-packages"):
        HarnessTools(pip_venvs=(tmp_path / "not-a-venv",))
    root = venv(tmp_path / "other", version="3.1")
    with pytest.raises(SandboxError, match=r"pip_venvs: the base of .* has no bin/python3\.1"):
        HarnessTools(pip_venvs=(root,))
    (root / "pyvenv.cfg").write_text("version = 3.1.0\n")
    with pytest.raises(SandboxError, match="names no `home` interpreter"):
        HarnessTools(pip_venvs=(root,))


def test_from_config_reads_sandbox_harness_tools(tmp_path: Path) -> None:
    prefix = npm_prefix(tmp_path, "claude")
    config = load_config(
        None, [f"sandbox.harness_tools.npm_dir={prefix}", f"sandbox.harness_tools.pip_venvs=[{venv(tmp_path)}]"]
    )
    tools = HarnessTools.from_config(config.sandbox.harness_tools)
    try:
        assert tools.npm_dir == prefix.resolve()
        assert tools.provision(install_of("claude-code")).mounts[0].source == prefix.resolve()
        with pytest.raises(SandboxError, match="mini is not a console script of any"):
            tools.provision(install_of("mini-swe-agent"))
    finally:
        tools.close()


def test_pip_harness_gets_its_venv_its_interpreter_and_launchers(tmp_path: Path) -> None:
    root = venv(tmp_path)
    tools = HarnessTools(pip_venvs=(root,))
    provision = tools.provision(InstallSpec(kind="pip", package="demo-cli", binary="democli"))
    site, python, launchers = provision.mounts
    assert site == ToolMount(root / "lib" / f"python{HOST_VERSION}" / "site-packages", "/opt/legorl/venv0/site")
    assert python == ToolMount(BASE_PREFIX, "/opt/legorl/venv0/python")
    assert launchers.target == "/opt/legorl/venv0/bin" and provision.path == ("/opt/legorl/venv0/bin",)
    script = (launchers.source / "democli").read_text()
    interpreter = f"/opt/legorl/venv0/python/bin/python{HOST_VERSION}"
    assert f"exec {interpreter} -I -S /opt/legorl/venv0/bin/venv_runner.py" in script
    assert script.rstrip().endswith('demo_cli.main:App.run democli "$@"')
    for path in (launchers.source, launchers.source.parent, launchers.source / "democli"):
        assert path.stat().st_mode & 0o755 == 0o755, path  # the agent user must reach and run them
    assert tools.provision(install_of("claude-code")) == Provision()  # no npm prefix configured
    tools.close()
    assert not launchers.source.exists()


def run_runner(runner: Path, site: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The runner as a launcher execs it, on this host's interpreter (the sandbox's mounted one stands in)."""
    return subprocess.run(
        [sys.executable, "-I", "-S", str(runner), "/opt/lib", str(site), "demo_cli.main:App.run", "democli", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )


def test_runner_runs_the_entry_point_with_its_arguments(tmp_path: Path) -> None:
    site = next(venv(tmp_path).glob("lib/*/site-packages"))
    done = run_runner(Path(venv_runner.__file__), site, "-t", "a task", env={"LD_LIBRARY_PATH": "/opt/lib"})
    assert done.returncode == 2, done.stderr  # the entry point's return value is the exit status
    assert done.stdout.strip() == "['democli', '-t', 'a task']"


def test_runner_keeps_the_sandbox_environment_out(tmp_path: Path) -> None:
    """A task's PYTHONPATH cannot shadow the harness's modules, and the interpreter's
    LD_LIBRARY_PATH does not reach the agent's commands."""
    site = next(venv(tmp_path).glob("lib/*/site-packages"))
    shadow = tmp_path / "shadow" / "demo_cli"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise SystemExit('shadowed')\n")
    (shadow / "main.py").write_text("")
    (site / "demo_cli" / "main.py").write_text(
        "import os, sys\nclass App:\n    run = staticmethod(lambda: print(os.environ.get('LD_LIBRARY_PATH')))\n"
    )
    done = run_runner(
        Path(venv_runner.__file__), site, env={"PYTHONPATH": str(shadow.parent), "LD_LIBRARY_PATH": "/opt/lib"}
    )
    assert (done.returncode, done.stdout.strip()) == (0, "None"), done.stderr


def test_bind_mounts_need_absolute_existing_paths(tmp_path: Path) -> None:
    (mount,) = _bind_mounts((ToolMount(tmp_path, "/opt/x"),))
    assert (mount["Source"], mount["Target"], mount["ReadOnly"]) == (str(tmp_path), "/opt/x", True)
    assert mount["Type"] == "bind"
    with pytest.raises(SandboxError, match="must be absolute"):
        _bind_mounts((ToolMount(tmp_path, "opt/x"),))
    with pytest.raises(SandboxError, match="does not exist on this host"):
        _bind_mounts((ToolMount(tmp_path / "gone", "/opt/x"),))
