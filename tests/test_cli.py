"""The `legorl` console script, run as a user runs it."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from legorl_jax.cli import SUBCOMMANDS
from legorl_jax.core.errors import disk_full


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


CTRL_C_AT_START_UP = """
import signal, sys, types
from legorl_jax import cli, commands

def run(args):
    try:
        signal.raise_signal(signal.SIGINT)  # Ctrl-C, landing in an import or a library
    except KeyboardInterrupt:
        if args.how == "import":  # as jaxlib's extension does
            raise ImportError("Encountered an error while initializing the extension.") from None
        # "dropped": caught and forgotten
    if args.how == "unraisable":  # where Python cannot raise it: it reports it and goes on
        class Dropped:
            def __del__(self):
                signal.raise_signal(signal.SIGINT)
        Dropped()
    commands.raise_if_interrupted()
    print("went on")
    return 0

fake = types.ModuleType("fake_cmd")
fake.add_arguments = lambda parser: parser.add_argument("how")
fake.run = run
sys.modules["fake_cmd"] = fake
cli.SUBCOMMANDS["fake"] = ("fake_cmd", "a stand-in")
# As from a terminal, even where the suite runs as a background job (which starts with Ctrl-C ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(cli.main(["fake", sys.argv[1]]))
"""


@pytest.mark.parametrize("how", ["import", "dropped", "unraisable"])
def test_ctrl_c_during_start_up_ends_quietly_however_a_library_takes_it(how: str) -> None:
    """Ctrl-C before a command handles SIGINT itself: exit 130 and one line, no traceback,
    even when the interrupt became an ImportError or was caught and dropped on the way."""
    done = subprocess.run([sys.executable, "-c", CTRL_C_AT_START_UP, how], capture_output=True, text=True, timeout=60)
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr and "went on" not in done.stdout, done.stderr
    assert done.stderr.startswith("legorl fake: interrupted"), done.stderr


def test_what_the_user_fixes_is_one_error_not_a_traceback(tmp_path: Path) -> None:
    """`InputError`s (here a task that is no task, a model directory that is none) print their message alone."""
    task = legorl("eval", "--model", str(tmp_path), "--tasks", str(tmp_path / "none"))
    assert task.returncode == 1, task.stderr
    assert task.stderr.startswith(f"legorl eval: task {tmp_path / 'none'}: ") and "Traceback" not in task.stderr
    engine = legorl("eval", "--model", str(tmp_path / "missing"))  # the demo's tasks
    assert engine.returncode == 1, engine.stderr
    assert engine.stderr.startswith("legorl eval: the engine exited with code 1 before becoming healthy")
    assert "no config.json" in engine.stderr and "Traceback" not in engine.stderr.split("last output:")[0]


def _chained(outer: Exception, inner: BaseException) -> Exception:
    outer.__cause__ = inner
    return outer


@pytest.mark.parametrize(
    "exc",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        # orbax wraps tensorstore's error in its own, and the loop wraps that once more
        _chained(
            RuntimeError("the checkpoint of step 2 did not finish"),
            ValueError(
                'RESOURCE_EXHAUSTED: Error writing "mu" in OCDBT database: Failed to write 1345787 bytes to file 37: '
                "No space left on device [os_error_code='28']"
            ),
        ),
        OSError("944128 requested and 8192 written"),  # numpy's tofile on a full disk
    ],
    ids=["errno", "wrapped-orbax", "numpy-short-write"],
)
def test_a_full_disk_is_recognised_through_wrapping(exc: Exception) -> None:
    assert disk_full(exc) is not None


def test_a_long_message_keeps_the_words_that_say_the_disk_is_full() -> None:
    spec = '{"driver": "zarr", "kvstore": {"path": "/tmp/run/checkpoints/1"}} ' * 40  # tensorstore quotes its spec
    why = disk_full(ValueError(f"RESOURCE_EXHAUSTED: Error opening {spec}: No space left on device {spec}"))
    assert why is not None and why.startswith("RESOURCE_EXHAUSTED: Error opening") and "No space left on device" in why
    assert len(why) < 500


def test_other_errors_are_not_taken_for_a_full_disk() -> None:
    assert disk_full(_chained(RuntimeError("boom"), OSError(errno.EACCES, "Permission denied"))) is None
