"""The package layers hold at run time (a rollout host loads no jax) and every
module has a layer. The import graph itself is checked by `lint-imports`
against pyproject.toml's contracts."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import legorl_jax

ROOT = Path(__file__).resolve().parents[1]

# Every module of the rollout side and the core, imported the way a rollout host would.
_IMPORT_ALL = """
import importlib, json, pkgutil, sys
import legorl_jax.core, rollout_server
for pkg in (legorl_jax.core, rollout_server):
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(info.name)
importlib.import_module("legorl_jax.commands.rollout_server_cmd")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "orbax"))))
"""


def test_rollout_host_imports_no_jax() -> None:
    done = subprocess.run([sys.executable, "-c", _IMPORT_ALL], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_every_learner_package_module_has_a_layer() -> None:
    """A new module under legorl_jax/ must be placed in the layers contracts,
    else lint-imports would check nothing about it."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    learner = next(c for c in contracts if c["name"].startswith("learner:"))
    placed = {name.strip() for layer in learner["layers"] for name in layer.split(":")}
    children = {f"legorl_jax.{m.name}" for m in pkgutil.iter_modules(legorl_jax.__path__)}
    assert children - placed == set()
