"""The `legorl` console script, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import yaml

from legorl_jax.cli import SUBCOMMANDS


def legorl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "legorl_jax.cli", *args], capture_output=True, text=True, timeout=120)


def test_help_lists_every_registered_subcommand_and_each_help_works() -> None:
    top = legorl("--help")
    assert top.returncode == 0
    for name in SUBCOMMANDS:
        assert name in top.stdout
        sub = legorl(name, "--help")
        assert sub.returncode == 0, sub.stderr


def test_config_show_applies_overrides() -> None:
    proc = legorl("config", "show", "--set", "rl.group_size=6")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["rl"]["group_size"] == 6


def test_config_schema_is_json_schema() -> None:
    proc = legorl("config", "schema")
    schema = json.loads(proc.stdout)
    assert schema["additionalProperties"] is False
    assert "rl" in schema["properties"]


def test_config_error_exits_2_with_message() -> None:
    proc = legorl("config", "show", "--set", "rl.group_size=one")
    assert proc.returncode == 2
    assert "rl.group_size" in proc.stderr
    assert "Traceback" not in proc.stderr
